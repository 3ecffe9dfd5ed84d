// The fleet index's hash table and lookup (radixkv.fleet.index) in C, as functions of the library's
// Python module (no torch dispatch: a call costs about a microsecond, not twenty).  Each replaces a
// dozen numpy calls of a few microseconds each, or a numpy probe that reads its table twice a key.
//
//   index_find(table, bits, keys, vals_out, slots_out) -> None
//   index_put(table, bits, keys, vals, slots_out) -> int (slots claimed)
//   index_walk(table, bits, hashes, mask, order, starts, best, keys, kinds, answer) -> list | dict | None
//   index_gather(seqs, out) -> bool | None
//
// table: uint8 [12 << bits], slots of a packed uint64 key and int32 value (a block id >= 0, -1 for
// an empty slot, -2 for a deleted one): one cache line holds a slot's key and value.  The slot of a
// key: (key * 0x9E3779B97F4A7C15) >> (64 - bits), then the next slots (linear probing, wrapping).
// keys: uint64 [n]; vals: int32 [n]; vals_out: int32 [n]; slots_out: int64 [n] (written).
//
// index_find: per key, its value and slot, or -1 and -1.  index_put: sets each key (in order) to its
// value, claiming the first empty slot from its home for a key the table lacks (deleted slots are
// passed, as the numpy path does); slots_out gets each key's slot.  The caller keeps the table at
// most 70% full, so a probe ends; a table with no empty slot left is a ValueError.
//
// index_walk: hashes is a uint64 buffer or a list or tuple of ints (converted as far as the walk
// goes; None when it reaches an element that is not an int in [0, 2**64): the caller's numpy path
// answers).  mask: [ids, words] C-contiguous unsigned words of 1, 2, 4 or 8 bytes: bit b of an id
// (word b / width, bit b % width) is set where (instance, medium) pair b holds the block.  order:
// int64 [pairs], bit numbers, grouped: group g is order[starts[g] : starts[g + 1]], fastest first;
// starts: int64 [groups + 1], from 0 to pairs, non-decreasing.  The walk goes from hash 0 and stops
// at the first hash the table lacks or once every group's run has ended.  A group's run is the
// leading run of positions where some bit of the group is set; counts[k] is how many positions of
// its group's run have bit order[k] as the group's first set bit (a group of one bit: that bit's
// own leading run, Index.lookup; a group per instance: Index.lookup_spread).  best: None, and the
// answer is counts; or int64 [sets + 1], from 0 to pairs, non-decreasing, cutting the pairs into
// sets (an instance's pairs, fastest first), and the answer is [k, counts[k], ...]: per set whose
// counts are not all 0, its first pair of the largest count (Index.lookup's pick).  answer: None, or
// with best a tuple (match, names, media): match a tuple subclass of two fields, names and media
// tuples of an entry per pair; the answer is then {names[k]: match(counts[k], media[k])} for those
// picks (Index.lookup's dict, built here: a Python loop over 16 picks costs more than the walk).  keys: uint64
// [ids], each id's hash where the table holds it; kinds: int8 [ids], bit 2 set where the id's hash is
// not in the table (Index keeps it in a dict, or the id is free).  A chain stored at once gets
// consecutive ids, so the walk, having found hash i at id k, takes id k + 1 for hash i + 1 when
// keys[k + 1] is that hash and bit 2 of kinds[k + 1] is clear (the table maps a hash to one id, so
// this is the id a probe would find): sequential reads instead of a random one.  Else it probes the
// table, prefetching the home slots of the next kAhead hashes and the found id's mask row (a chain
// whose ids are not consecutive costs one overlapped cache miss a block, as a probe of every block
// would).  Cost: O(positions walked x words) plus O(pairs) where the masked row changes.
//
// index_gather: the hashes of seqs (a list of lists or tuples of hashes: a run of BlockStored
// events), in order, into out (uint64 [their total], written); True when every one is an int in
// [0, 2**64) and none repeats, False when one repeats, None (out partly written) when one is not
// such an int or a seq is not a list or tuple: the caller's Python path then takes them.
//
// Whatever the arguments hold, nothing is read or written out of bounds: sizes are checked, a probe
// visits at most 1 << bits slots, an id past the mask's rows is a ValueError.  Bad arguments are a
// TypeError or ValueError that names the function and the argument.

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native.h"

namespace {

constexpr uint64_t kMix = 0x9E3779B97F4A7C15ULL;
constexpr int32_t kEmpty = -1;
constexpr int64_t kSlot = 12;    // bytes of a slot: uint64 key, int32 value, packed
constexpr int64_t kChunk = 256;  // positions probed before they are walked
constexpr int64_t kAhead = 24;   // prefetch distance, in probes or rows
constexpr uint64_t kNone = ~uint64_t{0};

// A buffer held for the length of a call.
struct Buffer {
  Py_buffer view{};
  bool held = false;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (held) PyBuffer_Release(&view);
  }
  // A C-contiguous buffer of integers of `itemsize` bytes (0: 1, 2, 4 or 8) and `ndim` dimensions.
  bool get(PyObject* obj, const char* fn, const char* name, int64_t itemsize, int ndim, bool writable) {
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view, flags) != 0) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "%s: %s must be a%s C-contiguous integer array, got %.100s", fn, name,
                   writable ? " writable" : "", Py_TYPE(obj)->tp_name);
      return false;
    }
    held = true;
    const char* f = view.format ? view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    const bool integer = f[0] != '\0' && f[1] == '\0' && std::strchr("bBhHiIlLqQ", f[0]) != nullptr;
    const int64_t size = view.itemsize;
    if (!integer || (itemsize ? size != itemsize : (size != 1 && size != 2 && size != 4 && size != 8)) ||
        view.ndim != ndim) {
      PyErr_Format(PyExc_TypeError, "%s: %s must be %d-D of %d-byte integers, got format %s, %d-D", fn, name,
                   ndim, static_cast<int>(itemsize ? itemsize : size), view.format ? view.format : "B",
                   view.ndim);
      return false;
    }
    return true;
  }
  int64_t len() const { return view.ndim ? view.shape[0] : 1; }
};

// Per id: its hash and whether it is in the table (the walk's check of the next id).
struct Ids {
  const uint64_t* keys;
  const int8_t* kinds;
  static constexpr int8_t kNotInTable = 4;
};

struct Table {
  const unsigned char* base;
  unsigned char* wbase;
  uint64_t last;
  int shift;

  uint64_t home(uint64_t key) const { return shift == 64 ? 0 : (key * kMix) >> shift; }
  uint64_t key(uint64_t s) const {
    uint64_t k;
    std::memcpy(&k, base + s * kSlot, 8);
    return k;
  }
  int32_t val(uint64_t s) const {
    int32_t v;
    std::memcpy(&v, base + s * kSlot + 8, 4);
    return v;
  }
  void set(uint64_t s, uint64_t k, int32_t v) {
    std::memcpy(wbase + s * kSlot, &k, 8);
    std::memcpy(wbase + s * kSlot + 8, &v, 4);
  }
  void prefetch(uint64_t s) const { __builtin_prefetch(base + s * kSlot); }
  // The slot from `s` on that holds `key` (*hit) or is empty (!*hit); kNone when the table has neither.
  uint64_t probe(uint64_t key, uint64_t s, bool* hit) const {
    for (uint64_t step = 0; step <= last; ++step, s = (s + 1) & last) {
      const int32_t v = val(s);
      if (v == kEmpty) {
        *hit = false;
        return s;
      }
      if (v >= 0 && this->key(s) == key) {
        *hit = true;
        return s;
      }
    }
    *hit = false;
    return kNone;
  }
};

// The table argument and its bits, checked: a uint8 buffer of 12 << bits bytes.
bool get_table(PyObject* obj, PyObject* bits_obj, const char* fn, bool writable, Buffer* buf, Table* t) {
  const long bits = PyLong_AsLong(bits_obj);
  if (bits == -1 && PyErr_Occurred()) return false;
  if (bits < 1 || bits > 40) {
    PyErr_Format(PyExc_ValueError, "%s: bits must be in [1, 40], got %ld", fn, bits);
    return false;
  }
  if (!buf->get(obj, fn, "table", 1, 1, writable)) return false;
  if (buf->view.len != (kSlot << bits)) {
    PyErr_Format(PyExc_ValueError, "%s: table must be 12 << bits = %lld bytes, got %lld", fn,
                 static_cast<long long>(kSlot << bits), static_cast<long long>(buf->view.len));
    return false;
  }
  t->base = static_cast<const unsigned char*>(buf->view.buf);
  t->wbase = static_cast<unsigned char*>(buf->view.buf);
  t->last = (uint64_t{1} << bits) - 1;
  t->shift = 64 - static_cast<int>(bits);
  return true;
}

bool same_len(const char* fn, const char* name, const Buffer& b, int64_t n) {
  if (b.len() == n) return true;
  PyErr_Format(PyExc_ValueError, "%s: %s must have %lld entries like keys, got %lld", fn, name,
               static_cast<long long>(n), static_cast<long long>(b.len()));
  return false;
}

bool nargs(const char* fn, Py_ssize_t got, Py_ssize_t want) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", fn, want, got);
  return false;
}

// The arguments of index_find and index_put, checked: (table, bits, keys, vals, slots_out).
struct Probes {
  Buffer tb, kb, vb, sb;
  Table t;
  int64_t n = 0;
  bool parse(PyObject* const* args, Py_ssize_t n_args, const char* fn, const char* vals_name, bool put) {
    if (!nargs(fn, n_args, 5) || !get_table(args[0], args[1], fn, put, &tb, &t) ||
        !kb.get(args[2], fn, "keys", 8, 1, false) || !vb.get(args[3], fn, vals_name, 4, 1, !put) ||
        !sb.get(args[4], fn, "slots_out", 8, 1, true))
      return false;
    n = kb.len();
    return same_len(fn, vals_name, vb, n) && same_len(fn, "slots_out", sb, n);
  }
  const uint64_t* keys() const { return static_cast<const uint64_t*>(kb.view.buf); }
  int32_t* vals() const { return static_cast<int32_t*>(vb.view.buf); }
  int64_t* slots() const { return static_cast<int64_t*>(sb.view.buf); }
  // Probes every key in order, its slot prefetched kAhead keys ahead; visit(i, slot, hit) returns
  // false to stop.  The GIL is released meanwhile.
  template <typename Visit>
  void each(Visit visit) const {
    const uint64_t* k = keys();
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < std::min(kAhead, n); ++i) t.prefetch(t.home(k[i]));
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) t.prefetch(t.home(k[i + kAhead]));
      bool hit;
      const uint64_t s = t.probe(k[i], t.home(k[i]), &hit);
      if (!visit(i, s, hit)) break;
    }
    Py_END_ALLOW_THREADS
  }
};

PyObject* index_find(PyObject*, PyObject* const* args, Py_ssize_t n_args) {
  Probes p;
  if (!p.parse(args, n_args, "index_find", "vals_out", false)) return nullptr;
  int32_t* vals = p.vals();
  int64_t* slots = p.slots();
  p.each([&](int64_t i, uint64_t s, bool hit) {
    vals[i] = hit ? p.t.val(s) : -1;
    slots[i] = hit ? static_cast<int64_t>(s) : -1;
    return true;
  });
  Py_RETURN_NONE;
}

PyObject* index_put(PyObject*, PyObject* const* args, Py_ssize_t n_args) {
  Probes p;
  if (!p.parse(args, n_args, "index_put", "vals", true)) return nullptr;
  const uint64_t* keys = p.keys();
  const int32_t* vals = p.vals();
  int64_t* slots = p.slots();
  int64_t claimed = 0, full = -1;
  p.each([&](int64_t i, uint64_t s, bool hit) {
    if (s == kNone) {
      full = i;
      return false;
    }
    p.t.set(s, keys[i], vals[i]);
    claimed += !hit;
    slots[i] = static_cast<int64_t>(s);
    return true;
  });
  if (full >= 0) {
    PyErr_Format(PyExc_ValueError, "index_put: the table has no empty slot left for key %lld of %lld",
                 static_cast<long long>(full), static_cast<long long>(p.n));
    return nullptr;
  }
  return PyLong_FromLongLong(claimed);
}

// An exact int in [0, 2**64) as a uint64 (false for anything else), reading its digits directly:
// PyLong_AsUnsignedLongLong goes through a byte array for values of more than one digit.
inline bool as_u64(PyObject* item, uint64_t* out) {
  if (!PyLong_CheckExact(item)) return false;
  const auto* v = reinterpret_cast<PyLongObject*>(item);
#if PY_VERSION_HEX >= 0x030C0000
  const uintptr_t tag = v->long_value.lv_tag;
  if ((tag & 3) == 2) return false;  // negative
  const uintptr_t ndigits = tag >> 3;
  const digit* d = v->long_value.ob_digit;
#else
  const Py_ssize_t size = Py_SIZE(v);
  if (size < 0) return false;
  const uintptr_t ndigits = static_cast<uintptr_t>(size);
  const digit* d = v->ob_digit;
#endif
  static_assert(PyLong_SHIFT == 30 || PyLong_SHIFT == 15, "unexpected PyLong_SHIFT");
  constexpr uintptr_t kMaxDigits = (64 + PyLong_SHIFT - 1) / PyLong_SHIFT;
  if (ndigits > kMaxDigits) return false;
  if constexpr (PyLong_SHIFT == 30) {  // the usual build: up to 3 digits, written out
    if (ndigits == 3) {
      if (d[2] >> 4) return false;
      *out = uint64_t{d[0]} | (uint64_t{d[1]} << 30) | (uint64_t{d[2]} << 60);
      return true;
    }
    *out = ndigits == 2 ? uint64_t{d[0]} | (uint64_t{d[1]} << 30) : ndigits == 1 ? uint64_t{d[0]} : 0;
    return true;
  }
  uint64_t x = 0;
  for (uintptr_t i = ndigits; i-- > 0;) x = (x << PyLong_SHIFT) | d[i];
  if (ndigits == kMaxDigits && (d[ndigits - 1] >> (64 - PyLong_SHIFT * (kMaxDigits - 1))) != 0) return false;
  *out = x;
  return true;
}

// The hashes of a walk: a uint64 buffer, or a list or tuple of Python ints converted a chunk at a time.
struct Hashes {
  const uint64_t* array = nullptr;
  PyObject** items = nullptr;
  int64_t n = 0;

  // Hashes [base, base + m) into out; returns how many leading ones are ints in [0, 2**64).
  int64_t fill(int64_t base, int64_t m, uint64_t* out) const {
    if (array != nullptr) {
      std::memcpy(out, array + base, m * sizeof(uint64_t));
      return m;
    }
    for (int64_t i = 0; i < m; ++i) {
      if (base + i + 8 < n) __builtin_prefetch(items[base + i + 8]);  // the int objects, ahead
      if (!as_u64(items[base + i], out + i)) return i;
    }
    return m;
  }
};

template <typename W>
bool walk(const Table& t, const Hashes& hs, const Ids& per_id, const W* mask, int64_t rows, int64_t words,
          const int64_t* order, const int64_t* starts, int64_t groups, int64_t* counts, int64_t* bad_id) {
  constexpr int width = sizeof(W) * 8;
  const int64_t pairs = starts[groups];

  // The bits of the groups still running, as words; the row of the last position, masked by them.
  std::vector<W> act(words, 0), prev(words, 0);
  std::vector<int64_t> alive(groups), winner(groups, -1);
  for (int64_t g = 0; g < groups; ++g) alive[g] = g;
  for (int64_t k = 0; k < pairs; ++k) act[order[k] / width] |= W(W(1) << (order[k] % width));
  int64_t nalive = groups, same = 0;  // positions since the masked row last changed, owed to the winners
  bool started = false;
  W act0 = act[0], prev0 = prev[0];

  auto settle = [&]() {  // pay the positions owed to each running group's current first set bit
    if (same == 0) return;
    for (int64_t a = 0; a < nalive; ++a) counts[winner[alive[a]]] += same;
    same = 0;
  };

  // Each chunk: find its ids (runs of consecutive ids checked against their hashes, else a probe
  // with the next probes' slots prefetched), then walk their rows.
  int64_t ids[kChunk];
  uint64_t buf[kChunk];
  int64_t last_id = -1;  // the id of the position before
  for (int64_t base = 0; base < hs.n && nalive > 0; base += kChunk) {
    const int64_t m = std::min(kChunk, hs.n - base);
    const uint64_t* key = hs.array != nullptr ? hs.array + base : buf;  // an array is read in place
    const int64_t ok = hs.array != nullptr ? m : hs.fill(base, m, buf);
    int64_t found = ok, fetched = 0;  // positions below `fetched` have had their home slot prefetched
    for (int64_t i = 0; i < ok;) {
      if (last_id >= 0) {  // the run of positions whose ids follow the last one's
        int64_t c = last_id + 1;
        const int64_t stop = std::min(ok, i + (rows - c));
        while (i < stop && per_id.keys[c] == key[i] && (per_id.kinds[c] & Ids::kNotInTable) == 0) ids[i++] = c++;
        last_id = c - 1;
        if (i == ok) break;
      }
      for (fetched = std::max(fetched, i + 1); fetched < std::min(ok, i + 1 + kAhead); ++fetched)
        t.prefetch(t.home(key[fetched]));
      bool hit;
      const uint64_t s = t.probe(key[i], t.home(key[i]), &hit);
      if (!hit) {
        found = i;
        break;
      }
      const int32_t id = t.val(s);
      if (id >= rows) {
        *bad_id = id;
        return false;
      }
      __builtin_prefetch(mask + id * words);
      ids[i++] = last_id = id;
    }
    for (int64_t i = 0; i < found && nalive > 0; ++i) {
      const W* row = mask + ids[i] * words;
      if (words == 1) {  // one word (up to 64 pairs): the masked row in registers
        if (started) {
          int64_t j = i;
          while (j < found && W(mask[ids[j]] & act0) == prev0) ++j;
          same += j - i;
          if (j == found) break;
          i = j;
          row = mask + ids[i];
        }
      } else {
        bool changed = !started;
        for (int64_t w = 0; w < words; ++w) changed |= W(row[w] & act[w]) != prev[w];
        if (!changed) {
          ++same;
          continue;
        }
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
      act0 = act[0];
      prev0 = prev[0];
      same = 1;
    }
    if (found < ok) break;
    if (ok < m && nalive > 0) return false;  // the walk reached a hash that is not a 64-bit int
  }
  settle();
  return true;
}

PyObject* index_walk(PyObject*, PyObject* const* args, Py_ssize_t n_args) {
  const char* fn = "index_walk";
  Buffer tb, hb, mb, ob, sb, bb, kb, db;
  Table t;
  if (!nargs(fn, n_args, 10) || !get_table(args[0], args[1], fn, false, &tb, &t) ||
      !mb.get(args[3], fn, "mask", 0, 2, false) || !ob.get(args[4], fn, "order", 8, 1, false) ||
      !sb.get(args[5], fn, "starts", 8, 1, false) || !kb.get(args[7], fn, "keys", 8, 1, false) ||
      !db.get(args[8], fn, "kinds", 1, 1, false))
    return nullptr;
  const bool best = args[6] != Py_None;
  if (best && !bb.get(args[6], fn, "best", 8, 1, false)) return nullptr;
  PyObject* answer = args[9];
  PyTypeObject* match = nullptr;
  PyObject *names = nullptr, *media = nullptr;
  if (answer != Py_None) {
    const Py_ssize_t pairs_given = ob.len();
    if (!best || !PyTuple_CheckExact(answer) || PyTuple_GET_SIZE(answer) != 3 ||
        !PyType_Check(PyTuple_GET_ITEM(answer, 0)) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(answer, 0)), &PyTuple_Type) ||
        !PyTuple_CheckExact(PyTuple_GET_ITEM(answer, 1)) || !PyTuple_CheckExact(PyTuple_GET_ITEM(answer, 2)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(answer, 1)) != pairs_given ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(answer, 2)) != pairs_given) {
      PyErr_SetString(PyExc_TypeError,
                      "index_walk: answer must be None or, with best, (a tuple subclass, names, media), "
                      "names and media tuples of an entry per pair");
      return nullptr;
    }
    match = reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(answer, 0));
    names = PyTuple_GET_ITEM(answer, 1);
    media = PyTuple_GET_ITEM(answer, 2);
  }
  const auto* best_at = best ? static_cast<const int64_t*>(bb.view.buf) : nullptr;
  Hashes hs;
  PyObject* h = args[2];
  if (PyList_CheckExact(h) || PyTuple_CheckExact(h)) {  // a list cannot change size: no Python code runs below
    hs.items = PySequence_Fast_ITEMS(h);
    hs.n = PySequence_Fast_GET_SIZE(h);
  } else {
    if (!hb.get(h, fn, "hashes", 8, 1, false)) return nullptr;
    hs.array = static_cast<const uint64_t*>(hb.view.buf);
    hs.n = hb.len();
  }
  const int64_t rows = mb.view.shape[0], words = mb.view.shape[1], width = mb.view.itemsize * 8;
  const int64_t pairs = ob.len(), groups = sb.len() - 1;
  if (kb.len() != rows || db.len() != rows) {
    PyErr_Format(PyExc_ValueError,
                 "index_walk: keys and kinds must have an entry per mask row (%lld), got %lld and %lld",
                 static_cast<long long>(rows), static_cast<long long>(kb.len()), static_cast<long long>(db.len()));
    return nullptr;
  }
  const Ids per_id{static_cast<const uint64_t*>(kb.view.buf), static_cast<const int8_t*>(db.view.buf)};
  const auto* order = static_cast<const int64_t*>(ob.view.buf);
  const auto* starts = static_cast<const int64_t*>(sb.view.buf);
  if (words < 1 || groups < 0 || starts[0] != 0 || starts[groups] != pairs) {
    PyErr_SetString(PyExc_ValueError, "index_walk: mask must have a word a row, starts must run from 0 to len(order)");
    return nullptr;
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (starts[g] > starts[g + 1]) {
      PyErr_SetString(PyExc_ValueError, "index_walk: starts must not decrease");
      return nullptr;
    }
  }
  if (best) {
    bool ok = bb.len() >= 1 && best_at[0] == 0 && best_at[bb.len() - 1] == pairs;
    for (int64_t g = 0; ok && g + 1 < bb.len(); ++g) ok = best_at[g] <= best_at[g + 1];
    if (!ok) {
      PyErr_SetString(PyExc_ValueError, "index_walk: best must run from 0 to len(order), non-decreasing");
      return nullptr;
    }
  }
  for (int64_t k = 0; k < pairs; ++k) {
    if (order[k] < 0 || order[k] >= words * width) {
      PyErr_Format(PyExc_ValueError, "index_walk: bit %lld is past the mask's %lld", static_cast<long long>(order[k]),
                   static_cast<long long>(words * width));
      return nullptr;
    }
  }
  std::vector<int64_t> counts(pairs, 0);
  int64_t bad_id = -1;
  bool done = true;
  if (pairs > 0 && groups > 0) {
    const void* m = mb.view.buf;
    switch (mb.view.itemsize) {
      case 1:
        done = walk(t, hs, per_id, static_cast<const uint8_t*>(m), rows, words, order, starts, groups, counts.data(), &bad_id);
        break;
      case 2:
        done = walk(t, hs, per_id, static_cast<const uint16_t*>(m), rows, words, order, starts, groups, counts.data(), &bad_id);
        break;
      case 4:
        done = walk(t, hs, per_id, static_cast<const uint32_t*>(m), rows, words, order, starts, groups, counts.data(), &bad_id);
        break;
      default:
        done = walk(t, hs, per_id, static_cast<const uint64_t*>(m), rows, words, order, starts, groups, counts.data(), &bad_id);
    }
  }
  if (bad_id >= 0) {
    PyErr_Format(PyExc_ValueError, "index_walk: the table holds id %lld past the mask's %lld rows",
                 static_cast<long long>(bad_id), static_cast<long long>(rows));
    return nullptr;
  }
  if (!done) Py_RETURN_NONE;
  std::vector<int64_t> flat;  // the answer, as a flat list of ints
  if (best) {                 // per group of pairs of `best`, its first pair of the longest run, and the run
    for (int64_t g = 0; g + 1 < bb.len(); ++g) {
      int64_t top = 0, at = -1;
      for (int64_t k = best_at[g]; k < best_at[g + 1]; ++k)
        if (counts[k] > top) {
          top = counts[k];
          at = k;
        }
      if (at >= 0) flat.insert(flat.end(), {at, top});
    }
  } else {
    flat.swap(counts);
  }
  if (match != nullptr) {  // {names[k]: match(run, media[k])}, as tuple.__new__(match, ...) builds it
    PyObject* d = PyDict_New();
    for (size_t j = 0; d != nullptr && j + 1 < flat.size(); j += 2) {
      PyObject* run = PyLong_FromLongLong(flat[j + 1]);
      PyObject* m = run == nullptr ? nullptr : match->tp_alloc(match, 2);
      if (m == nullptr) {
        Py_XDECREF(run);
        Py_CLEAR(d);
        break;
      }
      PyObject* medium = PyTuple_GET_ITEM(media, flat[j]);
      Py_INCREF(medium);
      PyTuple_SET_ITEM(m, 0, run);
      PyTuple_SET_ITEM(m, 1, medium);
      const int err = PyDict_SetItem(d, PyTuple_GET_ITEM(names, flat[j]), m);
      Py_DECREF(m);
      if (err != 0) Py_CLEAR(d);
    }
    return d;
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(flat.size()));
  if (out == nullptr) return nullptr;
  for (size_t k = 0; k < flat.size(); ++k) {
    PyObject* c = PyLong_FromLongLong(flat[k]);
    if (c == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, k, c);
  }
  return out;
}

PyObject* index_gather(PyObject*, PyObject* const* args, Py_ssize_t n_args) {
  const char* fn = "index_gather";
  Buffer ob;
  if (!nargs(fn, n_args, 2) || !ob.get(args[1], fn, "out", 8, 1, true)) return nullptr;
  PyObject* seqs = args[0];
  if (!PyList_CheckExact(seqs)) {
    PyErr_Format(PyExc_TypeError, "index_gather: seqs must be a list, got %.100s", Py_TYPE(seqs)->tp_name);
    return nullptr;
  }
  const int64_t n = ob.len();
  if (n >= (int64_t{1} << 31)) {
    PyErr_SetString(PyExc_ValueError, "index_gather: at most 2**31 - 1 hashes at once");
    return nullptr;
  }
  auto* out = static_cast<uint64_t*>(ob.view.buf);
  int64_t at = 0;
  for (Py_ssize_t j = 0; j < PyList_GET_SIZE(seqs); ++j) {
    PyObject* seq = PyList_GET_ITEM(seqs, j);
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;  // the caller's Python path
    const Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    if (at + m > n) {
      PyErr_Format(PyExc_ValueError, "index_gather: out has room for %lld hashes, seqs hold more",
                   static_cast<long long>(n));
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < m; ++i)
      if (!as_u64(items[i], out + at++)) Py_RETURN_NONE;
  }
  if (at != n) {
    PyErr_Format(PyExc_ValueError, "index_gather: seqs hold %lld hashes, out has %lld", static_cast<long long>(at),
                 static_cast<long long>(n));
    return nullptr;
  }
  // Whether one repeats: a scratch table of positions + 1, at most half full.
  int shift = 64 - 4;
  while ((int64_t{1} << (64 - shift)) < 2 * n) --shift;
  const uint64_t last = (uint64_t{1} << (64 - shift)) - 1;
  std::vector<uint32_t> seen(last + 1, 0);
  bool repeat = false;
  Py_BEGIN_ALLOW_THREADS
  for (int64_t i = 0; i < n && !repeat; ++i) {
    for (uint64_t s = (out[i] * kMix) >> shift;; s = (s + 1) & last) {
      if (seen[s] == 0) {
        seen[s] = static_cast<uint32_t>(i + 1);
        break;
      }
      if (out[seen[s] - 1] == out[i]) {
        repeat = true;
        break;
      }
    }
  }
  Py_END_ALLOW_THREADS
  return PyBool_FromLong(!repeat);
}

PyMethodDef methods[] = {
    {"index_find", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(index_find)), METH_FASTCALL,
     "index_find(table, bits, keys, vals_out, slots_out): each key's value and slot, or -1 (cuda_ext/index_walk.cpp)"},
    {"index_put", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(index_put)), METH_FASTCALL,
     "index_put(table, bits, keys, vals, slots_out) -> slots claimed (cuda_ext/index_walk.cpp)"},
    {"index_walk", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(index_walk)), METH_FASTCALL,
     "index_walk(table, bits, hashes, mask, order, starts, best, keys, kinds, answer) -> counts, a dict or None (cuda_ext/index_walk.cpp)"},
    {"index_gather", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(index_gather)), METH_FASTCALL,
     "index_gather(seqs, out) -> whether distinct, or None (cuda_ext/index_walk.cpp)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

int radixkv_add_index_functions(PyObject* module) { return PyModule_AddFunctions(module, methods); }
