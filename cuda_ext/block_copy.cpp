// Block copies between the paged KV pool and contiguous chunk buffers: op schemas, argument
// checks and the CPU kernel.  The CUDA kernel (block_copy_cuda.cu) registers under the same ops.
//
//   radixkv::gather_pages(kv, page_ids, out, skip_pages):  out[l, s, (skip+i)*ps : (skip+i+1)*ps] = kv[l, s, page_ids[i]]
//   radixkv::scatter_pages(src, kv, page_ids, skip_pages): kv[l, s, page_ids[i]] = src[l, s, (skip+i)*ps : (skip+i+1)*ps]
//
// for every layer l, K/V side s and i < len(page_ids).  The CPU kernel is one parallel loop over
// all (layer, K/V, page) rows, each a single memcpy of page_size * heads * dim elements.

#include "block_copy.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace radixkv {

CopyPlan plan_copy(const char* op, const at::Tensor& kv, const at::Tensor& page_ids,
                   const at::Tensor& buf, const char* buf_name, int64_t skip_pages) {
  // kv: [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
  RKV_CHECK_DIM(op, "kv", kv, 6, "[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]");
  TORCH_CHECK_VALUE(kv.size(1) == 2, op, ": kv must hold K and V on its 2nd axis (size 2), got shape ",
                    kv.sizes());
  RKV_CHECK_CONTIGUOUS(op, "kv", kv);
  const int64_t num_layers = kv.size(0), num_pages = kv.size(2), page_size = kv.size(3);
  const int64_t heads = kv.size(4), dim = kv.size(5);
  TORCH_CHECK_VALUE(page_size >= 1, op, ": kv has page_size 0 (shape ", kv.sizes(), ")");

  // buf: [num_layers, 2, num_tokens, num_kv_heads, head_dim]
  RKV_CHECK_DIM(op, buf_name, buf, 5, "[num_layers, 2, num_tokens, num_kv_heads, head_dim]");
  TORCH_CHECK_VALUE(buf.size(0) == num_layers && buf.size(1) == 2 && buf.size(3) == heads &&
                        buf.size(4) == dim,
                    op, ": ", buf_name, " has shape ", buf.sizes(), " but the pool's KV needs [",
                    num_layers, ", 2, num_tokens, ", heads, ", ", dim, "]");
  TORCH_CHECK_TYPE(buf.scalar_type() == kv.scalar_type(), op, ": ", buf_name, " has dtype ",
                   buf.scalar_type(), " but the pool holds ", kv.scalar_type());
  RKV_CHECK_CONTIGUOUS(op, buf_name, buf);

  // page_ids: [n] int64
  TORCH_CHECK_TYPE(page_ids.scalar_type() == at::kLong, op, ": page_ids must be int64, got ",
                   page_ids.scalar_type());
  RKV_CHECK_DIM(op, "page_ids", page_ids, 1, "[n]");

  const int64_t n = page_ids.numel(), num_tokens = buf.size(2);
  TORCH_CHECK_VALUE(skip_pages >= 0, op, ": skip_pages must be >= 0, got ", skip_pages);
  // Written so that a huge skip_pages cannot overflow: skip + n <= floor(num_tokens / page_size).
  TORCH_CHECK_VALUE(skip_pages <= num_tokens / page_size - n, op, ": ", buf_name, " holds ",
                    num_tokens, " tokens: too few for skip_pages=", skip_pages, " plus ", n,
                    " pages of ", page_size, " tokens");
  const at::MemOverlapStatus overlap = at::get_overlap_status(kv, buf);
  TORCH_CHECK_VALUE(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
                    op, ": ", buf_name, " and kv share memory");

  CopyPlan plan;
  plan.num_pages = num_pages;
  plan.num_ids = n;
  plan.num_runs = 2 * num_layers * n;
  plan.row_bytes = page_size * heads * dim * static_cast<int64_t>(kv.element_size());
  plan.pool_lk_stride = num_pages * plan.row_bytes;
  plan.buf_lk_stride = num_tokens * heads * dim * static_cast<int64_t>(kv.element_size());
  plan.buf_offset = skip_pages * plan.row_bytes;
  return plan;
}

void check_page_ids(const char* op, const at::Tensor& page_ids_cpu, int64_t num_pages, bool unique) {
  // page_ids_cpu: [n] int64, contiguous, on the CPU
  const int64_t n = page_ids_cpu.numel();
  const int64_t* ids = page_ids_cpu.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < num_pages, op, ": page_ids[", i, "] = ", ids[i],
                      " is outside the pool's [0, ", num_pages, ")");
  }
  if (unique && n > 1) {
    std::vector<int64_t> sorted(ids, ids + n);
    std::sort(sorted.begin(), sorted.end());
    const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    TORCH_CHECK_VALUE(dup == sorted.end(), op, ": page_ids holds page ", *dup,
                      " more than once; a scatter would write it twice");
  }
}

namespace {

// Below this many bytes per thread a copy stays on one thread: forking costs more than it saves.
constexpr int64_t kMinBytesPerThread = 256 << 10;

// Starts the page walks and first DRAM reads of a pool row that is copied next, one cache line in
// each 4 KiB page: rows are random pages of a large pool, and the hardware prefetcher, which stops at
// page boundaries, would start each of them from a miss (here: 7-10% faster gathers of 32 KiB rows).
inline void prefetch_pool_row(const char* row, int64_t bytes, bool for_write) {
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

void copy_rows_cpu(char* pool, char* buf, const int64_t* ids, const CopyPlan& p, bool to_buf) {
  // pool: [2 * num_layers, num_pages, row_bytes] bytes;  buf: [2 * num_layers, buf_lk_stride] bytes
  // run r = lk * n + i copies pool row ids[i] of slab lk <-> buffer row i of slab lk (after the skip).
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / std::max<int64_t>(1, p.row_bytes));
  const auto pool_row = [&](int64_t r) {
    return pool + (r / p.num_ids) * p.pool_lk_stride + ids[r % p.num_ids] * p.row_bytes;
  };
  at::parallel_for(0, p.num_runs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (r + 1 < end) prefetch_pool_row(pool_row(r + 1), p.row_bytes, /*for_write=*/!to_buf);
      char* buf_row = buf + (r / p.num_ids) * p.buf_lk_stride + p.buf_offset + (r % p.num_ids) * p.row_bytes;
      if (to_buf) {
        std::memcpy(buf_row, pool_row(r), p.row_bytes);
      } else {
        std::memcpy(pool_row(r), buf_row, p.row_bytes);
      }
    }
  });
}

void check_cpu(const char* op, const at::Tensor& kv, const at::Tensor& page_ids, const at::Tensor& buf,
               const char* buf_name) {
  TORCH_CHECK_VALUE(kv.device().is_cpu() && page_ids.device().is_cpu() && buf.device().is_cpu(), op,
                    ": kv, page_ids and ", buf_name, " must all be on the CPU here, got ", kv.device(),
                    ", ", page_ids.device(), ", ", buf.device());
}

void gather_pages_cpu(const at::Tensor& kv, const at::Tensor& page_ids, const at::Tensor& out,
                      int64_t skip_pages) {
  constexpr const char* op = "gather_pages";
  check_cpu(op, kv, page_ids, out, "out");
  const CopyPlan plan = plan_copy(op, kv, page_ids, out, "out", skip_pages);
  const at::Tensor ids = page_ids.contiguous();
  check_page_ids(op, ids, plan.num_pages, /*unique=*/false);
  if (plan.num_runs == 0 || plan.row_bytes == 0) return;
  copy_rows_cpu(static_cast<char*>(kv.data_ptr()), static_cast<char*>(out.data_ptr()),
                ids.data_ptr<int64_t>(), plan, /*to_buf=*/true);
}

void scatter_pages_cpu(const at::Tensor& src, const at::Tensor& kv, const at::Tensor& page_ids,
                       int64_t skip_pages) {
  constexpr const char* op = "scatter_pages";
  check_cpu(op, kv, page_ids, src, "src");
  const CopyPlan plan = plan_copy(op, kv, page_ids, src, "src", skip_pages);
  const at::Tensor ids = page_ids.contiguous();
  check_page_ids(op, ids, plan.num_pages, /*unique=*/true);
  if (plan.num_runs == 0 || plan.row_bytes == 0) return;
  copy_rows_cpu(static_cast<char*>(kv.data_ptr()), static_cast<char*>(src.data_ptr()),
                ids.data_ptr<int64_t>(), plan, /*to_buf=*/false);
}

}  // namespace
}  // namespace radixkv

TORCH_LIBRARY(radixkv, m) {
  m.def("gather_pages(Tensor kv, Tensor page_ids, Tensor(a!) out, int skip_pages=0) -> ()");
  m.def("scatter_pages(Tensor src, Tensor(a!) kv, Tensor page_ids, int skip_pages=0) -> ()");
}

TORCH_LIBRARY_IMPL(radixkv, CPU, m) {
  m.impl("gather_pages", &radixkv::gather_pages_cpu);
  m.impl("scatter_pages", &radixkv::scatter_pages_cpu);
}
