// Block copies between KV blocks and contiguous chunk buffers: shared declarations.
//
//   layers[l]: [sides, num_blocks, block_size, heads, head_dim], any strides   (an engine's own KV)
//   buffer   : [num_layers, sides, num_tokens, heads, head_dim], contiguous    (a tier's chunk layout)
//
// The paged pool kv [num_layers, 2, num_pages, page_size, heads, head_dim] is the special case
// layers[l] = kv[l].  One block of one layer and side is a "row": a contiguous run of
// block_size * heads * head_dim elements in the buffer, and in the layer some "runs" of contiguous
// bytes (one run when the block is contiguous, one per (token, head) for [.., heads, block_size, D]
// layouts, one per element when head_dim is not the innermost axis).  A gather or scatter is
// num_layers * sides * len(ids) row copies: row i of every (layer, side) slab of the buffer,
// starting skip rows in, is block ids[i].  The kernels move bytes, so every dtype is the same.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

// Readable argument checks (they raise ValueError / TypeError in Python, never crash).
// `op` and `name` are C strings: the op and the argument as the Python caller knows them.
#define RKV_CHECK_DIM(op, name, x, d, layout)                                                \
  TORCH_CHECK_VALUE((x).dim() == (d), op, ": ", name, " must be ", d, "-D " layout ", got shape ", \
                    (x).sizes())
#define RKV_CHECK_CONTIGUOUS(op, name, x)                                           \
  TORCH_CHECK_VALUE((x).layout() == at::kStrided && (x).is_contiguous(), op, ": ", name, \
                    " must be a contiguous dense tensor (call .contiguous() first)")

namespace radixkv {

// The words an op's messages use: the pool ops and the block ops name their arguments differently.
struct OpNames {
  const char* op;     // "gather_pages", "scatter_blocks", ...
  const char* buf;    // "out" (a gather) or "src" (a scatter)
  const char* ids;    // "page_ids" or "block_ids"
  const char* skip;   // "skip_pages" or "skip_blocks"
  const char* owner;  // "the pool" or "the layers": where the ids point
  const char* unit;   // "page" or "block"
};

// Where one layer's blocks are, in bytes.  Run k of a row (k < n0 * n1 * n2, in buffer order) starts
// at  addr + side * side_stride + block * block_stride + a * s0 + b * s1 + c * s2  for
// k = (a * n1 + b) * n2 + c, and is run_bytes long; in the buffer, runs follow each other.
struct LayerGeom {
  int64_t addr;          // address of element [0, 0, 0, 0, 0]
  int64_t side_stride;   // bytes from side s to s + 1
  int64_t block_stride;  // bytes from block b to b + 1
  int64_t run_bytes;     // contiguous bytes per run: row_bytes when the block is contiguous
  int64_t n1, n2;        // the inner two of the three run indices' sizes (n0 = runs / (n1 * n2))
  int64_t s0, s1, s2;    // bytes between consecutive runs along each run index
};

// Geometry of one validated gather or scatter.
struct BlockPlan {
  std::vector<LayerGeom> layers;
  int64_t sides;          // K and V (2), or 1 (MLA)
  int64_t num_blocks;     // blocks in every layer: ids must be in [0, num_blocks)
  int64_t num_ids;        // n = len(ids): rows per (layer, side)
  int64_t num_rows;       // num_layers * sides * n: row copies in all
  int64_t row_bytes;      // one block of one layer and side: block_size * heads * head_dim * itemsize
  int64_t buf_ls_stride;  // bytes from one (layer, side) slab of the buffer to the next:
                          // num_tokens * heads * dim * itemsize
  int64_t buf_offset;     // bytes skipped at the start of each buffer slab: skip * row_bytes
};

// Checks shapes, dtypes, skip and overlap of layers / ids / buf, and returns the plan.
// Device checks are the caller's (they differ between CPU and CUDA).  `writable`: the layers are
// written (a scatter), so none may overlap itself.
//   layers : each [sides, num_blocks, block_size, heads, head_dim], one shape and dtype
//   ids    : [n] int64
//   buf    : [num_layers, sides, num_tokens, heads, head_dim], contiguous, num_tokens >= (skip + n) * block_size
BlockPlan plan_blocks(const OpNames& names, at::TensorList layers, const at::Tensor& ids, const at::Tensor& buf,
                      int64_t skip, bool writable);

// The pool's plan: checks kv [num_layers, 2, num_pages, page_size, heads, head_dim] is contiguous,
// then plans its layers kv[l] as plan_blocks does.
BlockPlan plan_pool(const OpNames& names, const at::Tensor& kv, const at::Tensor& ids, const at::Tensor& buf,
                    int64_t skip, bool writable);

// Checks every id of a CPU int64 tensor is in [0, num_blocks), and, for a scatter (unique=true),
// that no id appears twice: two rows written to one block would race.  O(n log n).
void check_ids(const OpNames& names, const at::Tensor& ids_cpu, int64_t num_blocks, bool unique);

// The layers' tensors: kv[l] of a pool, as plan_pool plans them (for device checks).
std::vector<at::Tensor> pool_layers(const at::Tensor& kv);

}  // namespace radixkv
