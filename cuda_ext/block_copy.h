// Block copies between the paged KV pool and contiguous chunk buffers: shared declarations.
//
//   pool kv : [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]   (K at 1st index 0, V at 1)
//   buffer  : [num_layers, 2, num_tokens, num_kv_heads, head_dim]             (a tier's chunk layout)
//
// One page of one layer, K or V, is a contiguous "row" of page_size * num_kv_heads * head_dim
// elements in both tensors, so a gather or scatter is 2 * num_layers * len(page_ids) row copies:
// row i of every (layer, K/V) slab of the buffer, starting skip_pages rows in, is pool page
// page_ids[i].  The kernels move bytes, so every dtype (fp32, fp16, bf16, fp8, int8) is the same.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// Readable argument checks (they raise ValueError / TypeError in Python, never crash).
// `op` and `name` are C strings: the op and the argument as the Python caller knows them.
#define RKV_CHECK_DIM(op, name, x, d, layout)                                                \
  TORCH_CHECK_VALUE((x).dim() == (d), op, ": ", name, " must be ", d, "-D " layout ", got shape ", \
                    (x).sizes())
#define RKV_CHECK_CONTIGUOUS(op, name, x)                                           \
  TORCH_CHECK_VALUE((x).layout() == at::kStrided && (x).is_contiguous(), op, ": ", name, \
                    " must be a contiguous dense tensor (call .contiguous() first)")

namespace radixkv {

// Geometry of one validated gather or scatter; strides and sizes in bytes.
struct CopyPlan {
  int64_t num_pages;       // pages in the pool
  int64_t num_ids;         // n = len(page_ids): rows per (layer, K/V)
  int64_t num_runs;        // 2 * num_layers * n: row copies in all
  int64_t row_bytes;       // one page of one layer, K or V: page_size * num_kv_heads * head_dim * itemsize
  int64_t pool_lk_stride;  // bytes from one (layer, K/V) slab of the pool to the next: num_pages * row_bytes
  int64_t buf_lk_stride;   // bytes from one (layer, K/V) slab of the buffer to the next: num_tokens * heads * dim * itemsize
  int64_t buf_offset;      // bytes skipped at the start of each buffer slab: skip_pages * row_bytes
};

// Checks shapes, dtypes, contiguity, skip_pages and overlap of kv / page_ids / buf, and returns
// the plan.  Device checks are the caller's (they differ between CPU and CUDA).
//   kv       : [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
//   page_ids : [n] int64
//   buf      : [num_layers, 2, num_tokens, num_kv_heads, head_dim], num_tokens >= (skip_pages + n) * page_size
// buf_name is "out" for a gather and "src" for a scatter.
CopyPlan plan_copy(const char* op, const at::Tensor& kv, const at::Tensor& page_ids,
                   const at::Tensor& buf, const char* buf_name, int64_t skip_pages);

// Checks every id of a CPU int64 tensor is in [0, num_pages), and, for a scatter (unique=true),
// that no id appears twice: two rows written to one page would race.  O(n log n).
void check_page_ids(const char* op, const at::Tensor& page_ids_cpu, int64_t num_pages, bool unique);

}  // namespace radixkv
