// The fleet index's lookup (radixkv.fleet.index) in one pass on the CPU: probe a prompt's block
// hashes in the index's open-addressing table and walk their holder masks from the start, where the
// numpy path takes a dozen array calls of a few microseconds each.
//
//   radixkv::index_walk(keys, vals, bits, hashes, mask, order, starts) -> Tensor counts
//
// keys: int64 [1 << bits] (the table's uint64 keys, viewed); vals: int32 [1 << bits], a block id
// >= 0, -1 for an empty slot, -2 for a deleted one; slot of a key: (key * 0x9E3779B97F4A7C15) >>
// (64 - bits), then the next slots (linear probing, wrapping).  hashes: int64 [n] (uint64, viewed).
// mask: [ids, words] of uint8 (or uint16/uint32/uint64 viewed as int16/int32/int64): bit b of an id
// (word b / width, bit b % width) is set where (instance, medium) pair b holds the block.
// order: int64 [pairs], bit numbers, grouped: group g is order[starts[g] : starts[g + 1]], fastest
// first; starts: int64 [groups + 1], starts[0] = 0, non-decreasing, starts[groups] = pairs.
//
// The walk goes from hash 0 and stops at the first hash the table lacks.  A group's run is the
// leading run of positions where some bit of the group is set; counts[k] is how many positions of
// its group's run have bit order[k] as the group's first set bit.  A group's run is the sum of its
// counts.  A group of one bit gives that bit's own leading run (Index.lookup); a group per instance
// gives Index.lookup_spread.  Cost: O(positions walked x words) plus O(pairs) where the masked row
// changes; probes run ahead of the walk with prefetches, so the table's cache misses overlap.
//
// Whatever the table holds, nothing is read out of bounds: a probe visits at most 1 << bits slots,
// and an id past the mask's rows is an error.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace radixkv {
namespace {

constexpr uint64_t kMix = 0x9E3779B97F4A7C15ULL;
constexpr int64_t kChunk = 256;  // positions probed before they are walked
constexpr int64_t kAhead = 16;   // prefetch distance, in probes or rows

#define CHECK_CPU_CONTIGUOUS(t, name)                                                     \
  TORCH_CHECK((t).device().is_cpu() && (t).is_contiguous(), "index_walk: " name \
              " must be a contiguous CPU tensor")

template <typename W>
void walk(const uint64_t* keys, const int32_t* vals, int64_t bits, const uint64_t* hashes, int64_t n,
          const W* mask, int64_t rows, int64_t words, const int64_t* order, const int64_t* starts, int64_t groups,
          int64_t* counts) {
  constexpr int width = sizeof(W) * 8;
  const uint64_t last = (uint64_t{1} << bits) - 1;
  const int shift = 64 - static_cast<int>(bits);
  const int64_t pairs = starts[groups];

  // The bits of the groups still running, as words; the row of the last position, masked by them.
  std::vector<W> act(words, 0), prev(words, 0);
  std::vector<int64_t> alive(groups), winner(groups, -1);
  for (int64_t g = 0; g < groups; ++g) alive[g] = g;
  for (int64_t k = 0; k < pairs; ++k) act[order[k] / width] |= W(W(1) << (order[k] % width));
  int64_t nalive = groups, same = 0;  // positions since the masked row last changed, owed to the winners
  bool started = false;

  auto settle = [&]() {  // pay the positions owed to each running group's current first set bit
    if (same == 0) return;
    for (int64_t a = 0; a < nalive; ++a) counts[winner[alive[a]]] += same;
    same = 0;
  };

  // Each chunk: probe its hashes (the table's slots prefetched kAhead probes ahead), then walk
  // their rows (each row prefetched kAhead positions ahead), so that the cache misses overlap.
  int64_t ids[kChunk];
  uint64_t slot[kChunk];
  for (int64_t base = 0; base < n && nalive > 0; base += kChunk) {
    const int64_t m = std::min(kChunk, n - base);
    for (int64_t i = 0; i < m; ++i) slot[i] = shift == 64 ? 0 : (hashes[base + i] * kMix) >> shift;
    for (int64_t i = 0; i < std::min(kAhead, m); ++i) {
      __builtin_prefetch(vals + slot[i]);
      __builtin_prefetch(keys + slot[i]);
    }
    int64_t found = m;
    for (int64_t i = 0; i < m; ++i) {
      if (i + kAhead < m) {
        __builtin_prefetch(vals + slot[i + kAhead]);
        __builtin_prefetch(keys + slot[i + kAhead]);
      }
      const uint64_t key = hashes[base + i];
      uint64_t s = slot[i];
      int64_t id = -1;
      for (uint64_t step = 0; step <= last; ++step, s = (s + 1) & last) {
        const int32_t v = vals[s];
        if (v == -1) break;
        if (v >= 0 && keys[s] == key) {
          id = v;
          break;
        }
      }
      if (id < 0) {
        found = i;
        break;
      }
      TORCH_CHECK(id < rows, "index_walk: the table holds id ", id, " past the mask's ", rows, " rows");
      ids[i] = id;
      if (i < kAhead) __builtin_prefetch(mask + id * words);
    }
    for (int64_t i = 0; i < found && nalive > 0; ++i) {
      if (i + kAhead < found) __builtin_prefetch(mask + ids[i + kAhead] * words);
      const W* row = mask + ids[i] * words;
      bool changed = !started;
      for (int64_t w = 0; w < words; ++w) changed |= W(row[w] & act[w]) != prev[w];
      if (!changed) {
        ++same;
        continue;
      }
      settle();
      started = true;
      // Re-evaluate each running group: its first set bit, or its run ends here.
      int64_t keep = 0;
      for (int64_t a = 0; a < nalive; ++a) {
        const int64_t g = alive[a];
        int64_t first = -1;
        for (int64_t k = starts[g]; k < starts[g + 1]; ++k) {
          const int64_t b = order[k];
          if ((row[b / width] >> (b % width)) & 1) {
            first = k;
            break;
          }
        }
        if (first < 0) {
          for (int64_t k = starts[g]; k < starts[g + 1]; ++k) act[order[k] / width] &= W(~(W(1) << (order[k] % width)));
        } else {
          winner[g] = first;
          alive[keep++] = g;
        }
      }
      nalive = keep;
      for (int64_t w = 0; w < words; ++w) prev[w] = W(row[w] & act[w]);
      same = 1;
    }
    if (found < m) break;
  }
  settle();
}

at::Tensor index_walk_cpu(const at::Tensor& keys, const at::Tensor& vals, int64_t bits, const at::Tensor& hashes,
                          const at::Tensor& mask, const at::Tensor& order, const at::Tensor& starts) {
  CHECK_CPU_CONTIGUOUS(keys, "keys");
  CHECK_CPU_CONTIGUOUS(vals, "vals");
  CHECK_CPU_CONTIGUOUS(hashes, "hashes");
  CHECK_CPU_CONTIGUOUS(mask, "mask");
  CHECK_CPU_CONTIGUOUS(order, "order");
  CHECK_CPU_CONTIGUOUS(starts, "starts");
  TORCH_CHECK(bits >= 0 && bits <= 40, "index_walk: bits must be in [0, 40], got ", bits);
  const int64_t size = int64_t{1} << bits;
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1 && keys.numel() == size,
              "index_walk: keys must be int64 [1 << bits]");
  TORCH_CHECK(vals.scalar_type() == at::kInt && vals.dim() == 1 && vals.numel() == size,
              "index_walk: vals must be int32 [1 << bits]");
  TORCH_CHECK(hashes.scalar_type() == at::kLong && hashes.dim() == 1, "index_walk: hashes must be an int64 vector");
  TORCH_CHECK(mask.dim() == 2 && mask.size(1) >= 1, "index_walk: mask must be [ids, words]");
  const auto wt = mask.scalar_type();
  TORCH_CHECK(wt == at::kByte || wt == at::kShort || wt == at::kInt || wt == at::kLong,
              "index_walk: mask must be uint8, int16, int32 or int64 (unsigned words viewed)");
  TORCH_CHECK(order.scalar_type() == at::kLong && order.dim() == 1, "index_walk: order must be an int64 vector");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 1 && starts.numel() >= 1,
              "index_walk: starts must be a non-empty int64 vector");
  const int64_t words = mask.size(1), width = mask.element_size() * 8, pairs = order.numel();
  const int64_t groups = starts.numel() - 1;
  const int64_t* o = order.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(st[0] == 0 && st[groups] == pairs, "index_walk: starts must run from 0 to len(order)");
  for (int64_t g = 0; g < groups; ++g) TORCH_CHECK(st[g] <= st[g + 1], "index_walk: starts must not decrease");
  for (int64_t k = 0; k < pairs; ++k)
    TORCH_CHECK(o[k] >= 0 && o[k] < words * width, "index_walk: bit ", o[k], " is past the mask's ", words * width);

  at::Tensor counts = at::zeros({pairs}, order.options());
  if (pairs == 0 || groups == 0) return counts;
  const auto* k = reinterpret_cast<const uint64_t*>(keys.data_ptr<int64_t>());
  const int32_t* v = vals.data_ptr<int32_t>();
  const auto* h = reinterpret_cast<const uint64_t*>(hashes.data_ptr<int64_t>());
  const int64_t n = hashes.numel(), rows = mask.size(0);
  int64_t* c = counts.data_ptr<int64_t>();
  switch (wt) {
    case at::kByte:
      walk<uint8_t>(k, v, bits, h, n, mask.data_ptr<uint8_t>(), rows, words, o, st, groups, c);
      break;
    case at::kShort:
      walk<uint16_t>(k, v, bits, h, n, reinterpret_cast<const uint16_t*>(mask.data_ptr<int16_t>()), rows, words, o,
                     st, groups, c);
      break;
    case at::kInt:
      walk<uint32_t>(k, v, bits, h, n, reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>()), rows, words, o,
                     st, groups, c);
      break;
    default:
      walk<uint64_t>(k, v, bits, h, n, reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>()), rows, words, o,
                     st, groups, c);
  }
  return counts;
}

}  // namespace
}  // namespace radixkv

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("index_walk(Tensor keys, Tensor vals, int bits, Tensor hashes, Tensor mask, Tensor order, Tensor starts) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixkv, CPU, m) { m.impl("index_walk", &radixkv::index_walk_cpu); }
