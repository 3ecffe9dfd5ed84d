// Block copies between the paged KV pool and contiguous chunk buffers: the CUDA kernel.
//
// One launch moves every (layer, K/V, page) row of a gather or scatter: grid.x walks the rows,
// grid.y splits a long row, and each thread moves 16-byte vectors (narrower only when a pointer or
// a stride is not 16-byte aligned).  The chunk buffer may be on the pool's GPU or in pinned host
// memory: pinned pages are mapped into the device's address space, so the kernel reads or writes
// them over the bus directly, with no staging buffer on the device and no second copy.
//
// Like every CUDA op this is asynchronous on the current stream: synchronise the stream before
// reading a pinned `out` on the host.  A pinned buffer from torch's caching host allocator is
// kept from reuse until the kernel is done, even if the caller drops it right after the call.

#include "block_copy.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace radixkv {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // vectors in flight per thread: loads first, then stores

// pool: [2 * num_layers, num_pages, row_bytes] bytes;  buf: [2 * num_layers, buf_lk_stride] bytes.
// Block (r, y) copies part y of row r = lk * n + i: pool row ids[i] of slab lk <-> buffer row i.
template <typename Vec, bool kToBuf>
__global__ void copy_rows_kernel(char* __restrict__ pool, char* __restrict__ buf,
                                 const int64_t* __restrict__ ids, CopyPlan p) {
  const int64_t r = blockIdx.x;
  const int64_t lk = r / p.num_ids, i = r % p.num_ids;
  char* pool_row = pool + lk * p.pool_lk_stride + ids[i] * p.row_bytes;
  char* buf_row = buf + lk * p.buf_lk_stride + p.buf_offset + i * p.row_bytes;
  const Vec* __restrict__ src = reinterpret_cast<const Vec*>(kToBuf ? pool_row : buf_row);
  Vec* __restrict__ dst = reinterpret_cast<Vec*>(kToBuf ? buf_row : pool_row);
  const int64_t num_vecs = p.row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t step = static_cast<int64_t>(gridDim.y) * kThreads * kUnroll;
  for (int64_t j0 = static_cast<int64_t>(blockIdx.y) * kThreads * kUnroll + threadIdx.x; j0 < num_vecs;
       j0 += step) {
    Vec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * kThreads;
      if (j < num_vecs) v[u] = src[j];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * kThreads;
      if (j < num_vecs) dst[j] = v[u];
    }
  }
}

template <typename Vec, bool kToBuf>
void launch_vec(char* pool, char* buf, const int64_t* ids, const CopyPlan& p, cudaStream_t stream) {
  const int64_t num_vecs = p.row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t per_block = static_cast<int64_t>(kThreads) * kUnroll;
  const int64_t parts = std::min<int64_t>((num_vecs + per_block - 1) / per_block, 65535);
  const dim3 grid(static_cast<unsigned>(p.num_runs), static_cast<unsigned>(parts));
  copy_rows_kernel<Vec, kToBuf><<<grid, kThreads, 0, stream>>>(pool, buf, ids, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The widest vector that every row start is aligned to.
template <bool kToBuf>
void launch(char* pool, char* buf, const int64_t* ids, const CopyPlan& p, cudaStream_t stream) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(pool) | reinterpret_cast<uintptr_t>(buf) |
                        static_cast<uint64_t>(p.row_bytes) | static_cast<uint64_t>(p.pool_lk_stride) |
                        static_cast<uint64_t>(p.buf_lk_stride) | static_cast<uint64_t>(p.buf_offset);
  if (bits % 16 == 0) {
    launch_vec<uint4, kToBuf>(pool, buf, ids, p, stream);
  } else if (bits % 8 == 0) {
    launch_vec<uint2, kToBuf>(pool, buf, ids, p, stream);
  } else if (bits % 4 == 0) {
    launch_vec<uint32_t, kToBuf>(pool, buf, ids, p, stream);
  } else if (bits % 2 == 0) {
    launch_vec<uint16_t, kToBuf>(pool, buf, ids, p, stream);
  } else {
    launch_vec<uint8_t, kToBuf>(pool, buf, ids, p, stream);
  }
}

// The address the device uses for buf: its own pointer on the pool's GPU, or the mapped address of
// pinned host memory.  Anything else (pageable host memory, another GPU) is refused.
char* device_address(const char* op, const at::Tensor& buf, const char* buf_name, const at::Tensor& kv) {
  if (buf.is_cuda()) {
    TORCH_CHECK_VALUE(buf.device() == kv.device(), op, ": ", buf_name, " is on ", buf.device(),
                      " but kv is on ", kv.device());
    return static_cast<char*>(buf.data_ptr());
  }
  TORCH_CHECK_VALUE(buf.is_cpu(), op, ": ", buf_name, " must be on ", kv.device(),
                    " or in pinned CPU memory, got ", buf.device());
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, buf.data_ptr());
  if (err != cudaSuccess) (void)cudaGetLastError();  // not sticky: clear it so no later call reports it
  TORCH_CHECK_VALUE(err == cudaSuccess && attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr,
                    op, ": ", buf_name, " is in pageable CPU memory; allocate it with pin_memory=True "
                    "(or call .pin_memory()) so that the GPU can reach it, or put it on ", kv.device());
  return static_cast<char*>(attr.devicePointer);
}

void copy_rows_cuda(const char* op, const at::Tensor& kv, const at::Tensor& page_ids, const at::Tensor& buf,
                    const char* buf_name, int64_t skip_pages, bool to_buf) {
  TORCH_CHECK_VALUE(kv.is_cuda(), op, ": kv must be on a CUDA device when ", buf_name,
                    " or page_ids is, got ", kv.device());
  TORCH_CHECK_VALUE(page_ids.is_cpu() || page_ids.is_cuda(), op, ": page_ids must be on the CPU or a GPU, got ",
                    page_ids.device());
  const c10::cuda::CUDAGuard guard(kv.device());
  const CopyPlan plan = plan_copy(op, kv, page_ids, buf, buf_name, skip_pages);
  TORCH_CHECK_VALUE(plan.num_runs <= std::numeric_limits<int32_t>::max(), op, ": ", plan.num_runs,
                    " page rows in one call is more than one launch can take; split the call");
  // Ids are checked on the host (ids already on the GPU are read back once: a sync).
  const at::Tensor ids_cpu = page_ids.is_cpu() ? page_ids.contiguous() : page_ids.to(at::kCPU).contiguous();
  check_page_ids(op, ids_cpu, plan.num_pages, /*unique=*/!to_buf);
  if (plan.num_runs == 0 || plan.row_bytes == 0) return;
  const at::Tensor ids = page_ids.is_cuda() && page_ids.device() == kv.device()
                             ? page_ids.contiguous()
                             : ids_cpu.to(kv.device(), /*non_blocking=*/true);

  char* buf_dev = device_address(op, buf, buf_name, kv);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(kv.device().index());
  char* pool = static_cast<char*>(kv.data_ptr());
  if (to_buf) {
    launch<true>(pool, buf_dev, ids.data_ptr<int64_t>(), plan, stream.stream());
  } else {
    launch<false>(pool, buf_dev, ids.data_ptr<int64_t>(), plan, stream.stream());
  }
  if (buf.is_cpu()) {
    // As torch does for non_blocking copies: the host allocator must not hand these pinned pages
    // to anyone else before the kernel is done with them.
    at::getHostAllocator(at::kCUDA)->record_event(buf.storage().mutable_data(),
                                                  buf.storage().data_ptr().get_context(), stream.unwrap());
  }
}

void gather_pages_cuda(const at::Tensor& kv, const at::Tensor& page_ids, const at::Tensor& out,
                       int64_t skip_pages) {
  copy_rows_cuda("gather_pages", kv, page_ids, out, "out", skip_pages, /*to_buf=*/true);
}

void scatter_pages_cuda(const at::Tensor& src, const at::Tensor& kv, const at::Tensor& page_ids,
                        int64_t skip_pages) {
  copy_rows_cuda("scatter_pages", kv, page_ids, src, "src", skip_pages, /*to_buf=*/false);
}

}  // namespace
}  // namespace radixkv

TORCH_LIBRARY_IMPL(radixkv, CUDA, m) {
  m.impl("gather_pages", &radixkv::gather_pages_cuda);
  m.impl("scatter_pages", &radixkv::scatter_pages_cuda);
}
