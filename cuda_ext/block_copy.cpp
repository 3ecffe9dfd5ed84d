// Block copies between KV blocks and contiguous chunk buffers: op schemas, argument checks, the
// geometry of a copy and the CPU kernel.  The CUDA kernel (block_copy_cuda.cu) registers under the
// same ops.
//
//   radixkv::gather_blocks(layers, block_ids, out, skip):  out[l, s, (skip+i)*bs + t] = layers[l][s, block_ids[i], t]
//   radixkv::scatter_blocks(src, layers, block_ids, skip): layers[l][s, block_ids[i], t] = src[l, s, (skip+i)*bs + t]
//   radixkv::gather_pages(kv, page_ids, out, skip) / scatter_pages(src, kv, page_ids, skip): the same
//       with layers[l] = kv[l] of a contiguous pool [num_layers, 2, num_pages, page_size, heads, dim]
//
// for every layer l, side s, i < len(ids) and token t < block_size.  The CPU kernel is one parallel
// loop over all (layer, side, block) rows, each a memcpy per contiguous run of the block.

#include "block_copy.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace radixkv {
namespace {

// Byte range [begin, end) that a strided tensor's elements lie in.
std::pair<int64_t, int64_t> byte_span(const at::Tensor& t) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto begin = reinterpret_cast<int64_t>(t.data_ptr());
  return {begin, begin + (last + 1) * static_cast<int64_t>(t.element_size())};
}

bool share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage() ||
      a.storage().data() != b.storage().data()) {
    return false;
  }
  const auto [a0, a1] = byte_span(a);
  const auto [b0, b1] = byte_span(b);
  return a0 < b1 && b0 < a1;
}

// One layer's block [block_size, heads, head_dim] as runs: the innermost axes whose strides chain
// make the contiguous run; the others (size > 1, adjacent ones merged where they chain) index runs.
LayerGeom layer_geom(const at::Tensor& t) {
  // t: [sides, num_blocks, block_size, heads, head_dim]
  const int64_t es = static_cast<int64_t>(t.element_size());
  const int64_t size[3] = {t.size(2), t.size(3), t.size(4)};
  const int64_t stride[3] = {t.stride(2) * es, t.stride(3) * es, t.stride(4) * es};
  int64_t run = es;
  int k = 2;
  while (k >= 0 && (size[k] == 1 || stride[k] == run)) run *= size[k--];
  std::vector<std::pair<int64_t, int64_t>> dims;  // (size, byte stride), outer to inner
  for (int d = 0; d <= k; ++d) {
    if (size[d] == 1) continue;
    if (!dims.empty() && dims.back().second == size[d] * stride[d]) {
      dims.back() = {dims.back().first * size[d], stride[d]};
    } else {
      dims.emplace_back(size[d], stride[d]);
    }
  }
  while (dims.size() < 3) dims.insert(dims.begin(), {1, 0});
  LayerGeom g;
  g.addr = reinterpret_cast<int64_t>(t.data_ptr());
  g.side_stride = t.stride(0) * es;
  g.block_stride = t.stride(1) * es;
  g.run_bytes = run;
  g.n1 = dims[1].first;
  g.n2 = dims[2].first;
  g.s0 = dims[0].second;
  g.s1 = dims[1].second;
  g.s2 = dims[2].second;
  return g;
}

}  // namespace

std::vector<at::Tensor> pool_layers(const at::Tensor& kv) { return kv.unbind(0); }

BlockPlan plan_blocks(const OpNames& nm, at::TensorList layers, const at::Tensor& ids, const at::Tensor& buf,
                      int64_t skip, bool writable) {
  const char* op = nm.op;
  TORCH_CHECK_VALUE(!layers.empty(), op, ": layers is empty: pass one tensor per layer");
  const at::Tensor& first = layers[0];
  for (size_t l = 0; l < layers.size(); ++l) {
    // layers[l]: [sides, num_blocks, block_size, heads, head_dim], any strides
    const at::Tensor& t = layers[l];
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": layers[", l, "] must be a dense (strided) tensor");
    TORCH_CHECK_VALUE(t.dim() == 5, op, ": layers[", l, "] must be 5-D [sides, num_blocks, block_size, heads, ",
                      "head_dim], got shape ", t.sizes());
    TORCH_CHECK_VALUE(t.sizes() == first.sizes(), op, ": layers[", l, "] has shape ", t.sizes(),
                      " but layers[0] has ", first.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == first.scalar_type(), op, ": layers[", l, "] has dtype ", t.scalar_type(),
                     " but layers[0] has ", first.scalar_type());
    TORCH_CHECK_VALUE(t.device() == first.device(), op, ": layers[", l, "] is on ", t.device(),
                      " but layers[0] is on ", first.device());
    TORCH_CHECK_VALUE(!writable || at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": layers[", l,
                      "] has elements that overlap; a scatter would write them twice");
  }
  const int64_t num_layers = static_cast<int64_t>(layers.size());
  const int64_t sides = first.size(0), num_blocks = first.size(1), block_size = first.size(2);
  const int64_t heads = first.size(3), dim = first.size(4);
  TORCH_CHECK_VALUE(sides >= 1 && block_size >= 1, op, ": ", nm.owner, " must have sides >= 1 and ", nm.unit,
                    "_size >= 1, got shape ", first.sizes());

  // buf: [num_layers, sides, num_tokens, heads, head_dim], contiguous
  RKV_CHECK_DIM(op, nm.buf, buf, 5, "[num_layers, sides, num_tokens, heads, head_dim]");
  TORCH_CHECK_VALUE(buf.size(0) == num_layers && buf.size(1) == sides && buf.size(3) == heads &&
                        buf.size(4) == dim,
                    op, ": ", nm.buf, " has shape ", buf.sizes(), " but the KV of ", nm.owner, " needs [",
                    num_layers, ", ", sides, ", num_tokens, ", heads, ", ", dim, "]");
  TORCH_CHECK_TYPE(buf.scalar_type() == first.scalar_type(), op, ": ", nm.buf, " has dtype ", buf.scalar_type(),
                   " but the KV of ", nm.owner, " is ", first.scalar_type());
  RKV_CHECK_CONTIGUOUS(op, nm.buf, buf);

  // ids: [n] int64
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong, op, ": ", nm.ids, " must be int64, got ", ids.scalar_type());
  RKV_CHECK_DIM(op, nm.ids, ids, 1, "[n]");

  const int64_t n = ids.numel(), num_tokens = buf.size(2);
  TORCH_CHECK_VALUE(skip >= 0, op, ": ", nm.skip, " must be >= 0, got ", skip);
  // Written so that a huge skip cannot overflow: skip + n <= floor(num_tokens / block_size).
  TORCH_CHECK_VALUE(skip <= num_tokens / block_size - n, op, ": ", nm.buf, " holds ", num_tokens,
                    " tokens: too few for ", nm.skip, "=", skip, " plus ", n, " ", nm.unit, "s of ", block_size,
                    " tokens");
  for (const at::Tensor& t : layers) {
    TORCH_CHECK_VALUE(!share_memory(t, buf), op, ": ", nm.buf, " and ", nm.owner, " share memory");
  }

  BlockPlan plan;
  const int64_t es = static_cast<int64_t>(first.element_size());
  plan.layers.reserve(layers.size());
  for (const at::Tensor& t : layers) plan.layers.push_back(layer_geom(t));
  plan.sides = sides;
  plan.num_blocks = num_blocks;
  plan.num_ids = n;
  plan.num_rows = num_layers * sides * n;
  plan.row_bytes = block_size * heads * dim * es;
  plan.buf_ls_stride = num_tokens * heads * dim * es;
  plan.buf_offset = skip * plan.row_bytes;
  return plan;
}

BlockPlan plan_pool(const OpNames& nm, const at::Tensor& kv, const at::Tensor& ids, const at::Tensor& buf,
                    int64_t skip, bool writable) {
  // kv: [num_layers, sides, num_pages, page_size, heads, dim], contiguous; sides: K and V (2) or packed (1)
  RKV_CHECK_DIM(nm.op, "kv", kv, 6, "[num_layers, sides, num_pages, page_size, num_kv_heads, head_dim]");
  TORCH_CHECK_VALUE(kv.size(1) == 1 || kv.size(1) == 2, nm.op,
                    ": kv must hold K and V (2) or one packed side (1) on its 2nd axis, got shape ", kv.sizes());
  RKV_CHECK_CONTIGUOUS(nm.op, "kv", kv);
  TORCH_CHECK_VALUE(kv.size(0) >= 1 && kv.size(3) >= 1, nm.op, ": kv has no layers or page_size 0 (shape ",
                    kv.sizes(), ")");
  return plan_blocks(nm, pool_layers(kv), ids, buf, skip, writable);
}

void check_ids(const OpNames& nm, const at::Tensor& ids_cpu, int64_t num_blocks, bool unique) {
  // ids_cpu: [n] int64, contiguous, on the CPU
  const int64_t n = ids_cpu.numel();
  const int64_t* ids = ids_cpu.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < num_blocks, nm.op, ": ", nm.ids, "[", i, "] = ", ids[i],
                      " is outside ", nm.owner, ": [0, ", num_blocks, ")");
  }
  if (unique && n > 1) {
    std::vector<int64_t> sorted(ids, ids + n);
    std::sort(sorted.begin(), sorted.end());
    const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    TORCH_CHECK_VALUE(dup == sorted.end(), nm.op, ": ", nm.ids, " holds ", nm.unit, " ", *dup,
                      " more than once; a scatter would write it twice");
  }
}

namespace {

// Below this many bytes per thread a copy stays on one thread.  Forking costs a few microseconds
// on an idle machine, but a whole scheduler time slice (milliseconds) when another thread holds
// the core the second OpenMP thread waits for: inside vLLM's engine process, 256 KiB per thread
// made a 512 KiB chunk load take 2-8 ms instead of 0.1 ms (benchmarks/results/vllm_cpu.txt).
constexpr int64_t kMinBytesPerThread = 4 << 20;

// Starts the page walks and first DRAM reads of a block row that is copied next, one cache line in
// each 4 KiB page: rows are random blocks of a large pool, and the hardware prefetcher, which stops
// at page boundaries, would start each of them from a miss (here: 7-10% faster gathers of 32 KiB rows).
inline void prefetch_row(const char* row, int64_t bytes, bool for_write) {
#if defined(__GNUC__) || defined(__clang__)
  for (int64_t k = 0; k < bytes; k += 4096) {
    if (for_write) {
      __builtin_prefetch(row + k, 1, 3);
    } else {
      __builtin_prefetch(row + k, 0, 3);
    }
  }
#endif
}

// The block of row r = (l * sides + s) * n + i in its layer: layers[l][s, ids[i]].
inline char* block_of(const BlockPlan& p, const int64_t* ids, int64_t r, const LayerGeom** geom) {
  const int64_t ls = r / p.num_ids, i = r % p.num_ids;
  const LayerGeom& g = p.layers[ls / p.sides];
  *geom = &g;
  return reinterpret_cast<char*>(g.addr) + (ls % p.sides) * g.side_stride + ids[i] * g.block_stride;
}

void copy_rows_cpu(const BlockPlan& p, char* buf, const int64_t* ids, bool to_buf) {
  // buf: [num_layers * sides, buf_ls_stride] bytes; row r = ls * n + i is buffer row i of slab ls
  // (after the skip) <-> block ids[i] of side ls % sides of layer ls / sides.
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / std::max<int64_t>(1, p.row_bytes));
  at::parallel_for(0, p.num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const LayerGeom* g = nullptr;
      char* block = block_of(p, ids, r, &g);
      char* row = buf + (r / p.num_ids) * p.buf_ls_stride + p.buf_offset + (r % p.num_ids) * p.row_bytes;
      const int64_t n0 = p.row_bytes / g->run_bytes / (g->n1 * g->n2);
      if (r + 1 < end) {
        // The next block, where its bytes are close together (a contiguous or a permuted block).
        const LayerGeom* next = nullptr;
        const char* next_block = block_of(p, ids, r + 1, &next);
        const int64_t next_n0 = p.row_bytes / next->run_bytes / (next->n1 * next->n2);
        const int64_t span = (next_n0 - 1) * next->s0 + (next->n1 - 1) * next->s1 + (next->n2 - 1) * next->s2 +
                             next->run_bytes;
        if (span <= 2 * p.row_bytes) prefetch_row(next_block, span, /*for_write=*/!to_buf);
      }
      if (g->run_bytes == p.row_bytes) {  // a contiguous block: one memcpy
        std::memcpy(to_buf ? row : block, to_buf ? block : row, p.row_bytes);
        continue;
      }
      for (int64_t a = 0; a < n0; ++a) {
        for (int64_t b = 0; b < g->n1; ++b) {
          for (int64_t c = 0; c < g->n2; ++c, row += g->run_bytes) {
            char* run = block + a * g->s0 + b * g->s1 + c * g->s2;
            std::memcpy(to_buf ? row : run, to_buf ? run : row, g->run_bytes);
          }
        }
      }
    }
  });
}

void check_cpu(const OpNames& nm, at::TensorList layers, const at::Tensor& ids, const at::Tensor& buf) {
  bool all_cpu = ids.device().is_cpu() && buf.device().is_cpu();
  for (const at::Tensor& t : layers) all_cpu = all_cpu && t.device().is_cpu();
  TORCH_CHECK_VALUE(all_cpu, nm.op, ": ", nm.owner, ", ", nm.ids, " and ", nm.buf,
                    " must all be on the CPU here, got ", nm.buf, " on ", buf.device(), " and ", nm.ids, " on ",
                    ids.device());
}

void run_cpu(const OpNames& nm, const BlockPlan& plan, const at::Tensor& ids, const at::Tensor& buf, bool to_buf) {
  const at::Tensor ids_c = ids.contiguous();
  check_ids(nm, ids_c, plan.num_blocks, /*unique=*/!to_buf);
  if (plan.num_rows == 0 || plan.row_bytes == 0) return;
  copy_rows_cpu(plan, static_cast<char*>(buf.data_ptr()), ids_c.data_ptr<int64_t>(), to_buf);
}

constexpr OpNames kGatherPages{"gather_pages", "out", "page_ids", "skip_pages", "the pool", "page"};
constexpr OpNames kScatterPages{"scatter_pages", "src", "page_ids", "skip_pages", "the pool", "page"};
constexpr OpNames kGatherBlocks{"gather_blocks", "out", "block_ids", "skip_blocks", "the layers", "block"};
constexpr OpNames kScatterBlocks{"scatter_blocks", "src", "block_ids", "skip_blocks", "the layers", "block"};

void gather_pages_cpu(const at::Tensor& kv, const at::Tensor& page_ids, const at::Tensor& out, int64_t skip) {
  check_cpu(kGatherPages, {kv}, page_ids, out);
  run_cpu(kGatherPages, plan_pool(kGatherPages, kv, page_ids, out, skip, false), page_ids, out, true);
}

void scatter_pages_cpu(const at::Tensor& src, const at::Tensor& kv, const at::Tensor& page_ids, int64_t skip) {
  check_cpu(kScatterPages, {kv}, page_ids, src);
  run_cpu(kScatterPages, plan_pool(kScatterPages, kv, page_ids, src, skip, true), page_ids, src, false);
}

void gather_blocks_cpu(at::TensorList layers, const at::Tensor& block_ids, const at::Tensor& out, int64_t skip) {
  check_cpu(kGatherBlocks, layers, block_ids, out);
  run_cpu(kGatherBlocks, plan_blocks(kGatherBlocks, layers, block_ids, out, skip, false), block_ids, out, true);
}

void scatter_blocks_cpu(const at::Tensor& src, at::TensorList layers, const at::Tensor& block_ids, int64_t skip) {
  check_cpu(kScatterBlocks, layers, block_ids, src);
  run_cpu(kScatterBlocks, plan_blocks(kScatterBlocks, layers, block_ids, src, skip, true), block_ids, src, false);
}

}  // namespace
}  // namespace radixkv

TORCH_LIBRARY(radixkv, m) {
  m.def("gather_pages(Tensor kv, Tensor page_ids, Tensor(a!) out, int skip_pages=0) -> ()");
  m.def("scatter_pages(Tensor src, Tensor(a!) kv, Tensor page_ids, int skip_pages=0) -> ()");
  m.def("gather_blocks(Tensor[] layers, Tensor block_ids, Tensor(a!) out, int skip_blocks=0) -> ()");
  m.def("scatter_blocks(Tensor src, Tensor(a!)[] layers, Tensor block_ids, int skip_blocks=0) -> ()");
}

TORCH_LIBRARY_IMPL(radixkv, CPU, m) {
  m.impl("gather_pages", &radixkv::gather_pages_cpu);
  m.impl("scatter_pages", &radixkv::scatter_pages_cpu);
  m.impl("gather_blocks", &radixkv::gather_blocks_cpu);
  m.impl("scatter_blocks", &radixkv::scatter_blocks_cpu);
}
