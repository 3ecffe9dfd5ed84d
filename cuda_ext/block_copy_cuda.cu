// Block copies between KV blocks and contiguous chunk buffers: the CUDA kernel.
//
// One launch moves every (layer, side, block) row of a gather or scatter, one thread block per row.
// A row is some runs of contiguous bytes in the layer (block_copy.h: one run for a contiguous block,
// one per (token, head) for a [.., heads, block_size, head_dim] layout) and one contiguous span in the
// buffer.  Each warp takes pieces of up to 32 * kUnroll vectors of one run, so a warp's lanes touch
// consecutive addresses on both sides; vectors are 16 bytes wide, narrower only when a pointer, a
// stride or a run length is not 16-byte aligned.  The chunk buffer may be on the layers' GPU or in
// pinned host memory: pinned pages are mapped into the device's address space, so the kernel reads
// or writes them over the bus directly, with no staging buffer on the device and no second copy.
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
#include <cstring>
#include <limits>

namespace radixkv {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // vectors in flight per lane: loads first, then stores

// The parts of a BlockPlan the kernel reads (the per-layer geometry is in device memory).
struct RowPlan {
  int64_t sides, num_ids, row_bytes, buf_ls_stride, buf_offset;
};

// Block r copies row r = (l * sides + s) * n + i: block ids[i] of side s of layer l <-> buffer row i
// of slab l * sides + s.  Warp w copies pieces w, w + kWarps, ... of the row's runs.
template <typename Vec, bool kToBuf>
__global__ void copy_blocks_kernel(char* __restrict__ buf, const int64_t* __restrict__ ids,
                                   const LayerGeom* __restrict__ geoms, RowPlan p) {
  const int64_t r = blockIdx.x;
  const int64_t ls = r / p.num_ids, i = r % p.num_ids;
  const LayerGeom g = geoms[ls / p.sides];
  char* block = reinterpret_cast<char*>(g.addr) + (ls % p.sides) * g.side_stride + ids[i] * g.block_stride;
  char* row = buf + ls * p.buf_ls_stride + p.buf_offset + i * p.row_bytes;
  const int64_t vecs_per_run = g.run_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t per_piece = 32 * kUnroll;
  const int64_t pieces_per_run = (vecs_per_run + per_piece - 1) / per_piece;
  const int64_t num_pieces = p.row_bytes / g.run_bytes * pieces_per_run;
  const int lane = threadIdx.x % 32;
  for (int64_t q = threadIdx.x / 32; q < num_pieces; q += kWarps) {
    const int64_t run = q / pieces_per_run, piece = q - run * pieces_per_run;
    const int64_t c = run % g.n2, ab = run / g.n2;
    const int64_t b = ab % g.n1, a = ab / g.n1;
    char* run_in_block = block + a * g.s0 + b * g.s1 + c * g.s2;
    char* run_in_row = row + run * g.run_bytes;
    const Vec* __restrict__ src = reinterpret_cast<const Vec*>(kToBuf ? run_in_block : run_in_row);
    Vec* __restrict__ dst = reinterpret_cast<Vec*>(kToBuf ? run_in_row : run_in_block);
    const int64_t j0 = piece * per_piece + lane;
    Vec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * 32;
      if (j < vecs_per_run) v[u] = src[j];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + u * 32;
      if (j < vecs_per_run) dst[j] = v[u];
    }
  }
}

template <typename Vec, bool kToBuf>
void launch_vec(char* buf, const int64_t* ids, const LayerGeom* geoms, const BlockPlan& p, cudaStream_t stream) {
  const RowPlan rp{p.sides, p.num_ids, p.row_bytes, p.buf_ls_stride, p.buf_offset};
  copy_blocks_kernel<Vec, kToBuf><<<static_cast<unsigned>(p.num_rows), kThreads, 0, stream>>>(buf, ids, geoms, rp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The widest vector that every address, stride and run length of the copy is a multiple of.
template <bool kToBuf>
void launch(char* buf, const int64_t* ids, const LayerGeom* geoms, const BlockPlan& p, cudaStream_t stream) {
  uint64_t bits = reinterpret_cast<uintptr_t>(buf) | static_cast<uint64_t>(p.row_bytes) |
                  static_cast<uint64_t>(p.buf_ls_stride) | static_cast<uint64_t>(p.buf_offset);
  for (const LayerGeom& g : p.layers) {
    bits |= static_cast<uint64_t>(g.addr) | static_cast<uint64_t>(g.side_stride) |
            static_cast<uint64_t>(g.block_stride) | static_cast<uint64_t>(g.run_bytes) |
            static_cast<uint64_t>(g.s0) | static_cast<uint64_t>(g.s1) | static_cast<uint64_t>(g.s2);
  }
  if (bits % 16 == 0) {
    launch_vec<uint4, kToBuf>(buf, ids, geoms, p, stream);
  } else if (bits % 8 == 0) {
    launch_vec<uint2, kToBuf>(buf, ids, geoms, p, stream);
  } else if (bits % 4 == 0) {
    launch_vec<uint32_t, kToBuf>(buf, ids, geoms, p, stream);
  } else if (bits % 2 == 0) {
    launch_vec<uint16_t, kToBuf>(buf, ids, geoms, p, stream);
  } else {
    launch_vec<uint8_t, kToBuf>(buf, ids, geoms, p, stream);
  }
}

// The address the device uses for buf: its own pointer on the layers' GPU, or the mapped address of
// pinned host memory.  Anything else (pageable host memory, another GPU) is refused.
char* device_address(const OpNames& nm, const at::Tensor& buf, const at::Device& device) {
  if (buf.is_cuda()) {
    TORCH_CHECK_VALUE(buf.device() == device, nm.op, ": ", nm.buf, " is on ", buf.device(), " but the KV of ",
                      nm.owner, " is on ", device);
    return static_cast<char*>(buf.data_ptr());
  }
  TORCH_CHECK_VALUE(buf.is_cpu(), nm.op, ": ", nm.buf, " must be on ", device, " or in pinned CPU memory, got ",
                    buf.device());
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, buf.data_ptr());
  if (err != cudaSuccess) (void)cudaGetLastError();  // not sticky: clear it so no later call reports it
  TORCH_CHECK_VALUE(err == cudaSuccess && attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr,
                    nm.op, ": ", nm.buf, " is in pageable CPU memory; allocate it with pin_memory=True "
                    "(or call .pin_memory()) so that the GPU can reach it, or put it on ", device);
  return static_cast<char*>(attr.devicePointer);
}

// As torch does for non_blocking copies: the host allocator must not hand these pinned pages to
// anyone else before the kernel is done with them.
void keep_pinned_until_done(const at::Tensor& host, const c10::cuda::CUDAStream& stream) {
  at::getHostAllocator(at::kCUDA)->record_event(host.storage().mutable_data(),
                                                host.storage().data_ptr().get_context(), stream.unwrap());
}

// Runs a planned copy on `device` (where the layers are).
void copy_blocks_cuda(const OpNames& nm, const at::Device& device, const at::Tensor& ids, const at::Tensor& buf,
                      bool to_buf, const BlockPlan& plan) {
  TORCH_CHECK_VALUE(ids.is_cpu() || ids.is_cuda(), nm.op, ": ", nm.ids, " must be on the CPU or a GPU, got ",
                    ids.device());
  TORCH_CHECK_VALUE(plan.num_rows <= std::numeric_limits<int32_t>::max(), nm.op, ": ", plan.num_rows,
                    " rows in one call is more than one launch can take; split the call");
  // Ids are checked on the host (ids already on the GPU are read back once: a sync).
  const at::Tensor ids_cpu = ids.is_cpu() ? ids.contiguous() : ids.to(at::kCPU).contiguous();
  check_ids(nm, ids_cpu, plan.num_blocks, /*unique=*/!to_buf);
  if (plan.num_rows == 0 || plan.row_bytes == 0) return;

  char* buf_dev = device_address(nm, buf, device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  // The ids and the per-layer geometry travel to the device through pinned memory, asynchronously.
  const auto pinned = at::TensorOptions().dtype(at::kLong).pinned_memory(true);
  const at::Tensor ids_dev = ids.is_cuda() && ids.device() == device
                                 ? ids.contiguous()
                                 : at::empty({ids_cpu.numel()}, pinned).copy_(ids_cpu).to(device, true);
  static_assert(sizeof(LayerGeom) % sizeof(int64_t) == 0, "LayerGeom is a record of int64");
  const int64_t geom_words = static_cast<int64_t>(plan.layers.size() * sizeof(LayerGeom) / sizeof(int64_t));
  at::Tensor geoms_host = at::empty({geom_words}, pinned);
  std::memcpy(geoms_host.data_ptr(), plan.layers.data(), plan.layers.size() * sizeof(LayerGeom));
  const at::Tensor geoms = geoms_host.to(device, /*non_blocking=*/true);
  const auto* geoms_dev = reinterpret_cast<const LayerGeom*>(geoms.data_ptr<int64_t>());
  if (to_buf) {
    launch<true>(buf_dev, ids_dev.data_ptr<int64_t>(), geoms_dev, plan, stream.stream());
  } else {
    launch<false>(buf_dev, ids_dev.data_ptr<int64_t>(), geoms_dev, plan, stream.stream());
  }
  if (buf.is_cpu()) keep_pinned_until_done(buf, stream);
}

void check_layers_on_a_gpu(const OpNames& nm, at::TensorList layers) {
  for (size_t l = 0; l < layers.size(); ++l) {
    TORCH_CHECK_VALUE(layers[l].is_cuda(), nm.op, ": layers[", l, "] is on ", layers[l].device(), " but ", nm.buf,
                      " or ", nm.ids, " is on a GPU: the layers must be on a CUDA device");
  }
}

constexpr OpNames kGatherPages{"gather_pages", "out", "page_ids", "skip_pages", "the pool", "page"};
constexpr OpNames kScatterPages{"scatter_pages", "src", "page_ids", "skip_pages", "the pool", "page"};
constexpr OpNames kGatherBlocks{"gather_blocks", "out", "block_ids", "skip_blocks", "the layers", "block"};
constexpr OpNames kScatterBlocks{"scatter_blocks", "src", "block_ids", "skip_blocks", "the layers", "block"};

void pool_cuda(const OpNames& nm, const at::Tensor& kv, const at::Tensor& ids, const at::Tensor& buf, int64_t skip,
               bool to_buf) {
  TORCH_CHECK_VALUE(kv.is_cuda(), nm.op, ": kv must be on a CUDA device when ", nm.buf, " or ", nm.ids,
                    " is, got ", kv.device());
  const c10::cuda::CUDAGuard guard(kv.device());
  const BlockPlan plan = plan_pool(nm, kv, ids, buf, skip, !to_buf);
  copy_blocks_cuda(nm, kv.device(), ids, buf, to_buf, plan);
}

void blocks_cuda(const OpNames& nm, at::TensorList layers, const at::Tensor& ids, const at::Tensor& buf, int64_t skip,
                 bool to_buf) {
  TORCH_CHECK_VALUE(!layers.empty(), nm.op, ": layers is empty: pass one tensor per layer");
  check_layers_on_a_gpu(nm, layers);
  const c10::cuda::CUDAGuard guard(layers[0].device());
  const BlockPlan plan = plan_blocks(nm, layers, ids, buf, skip, !to_buf);
  copy_blocks_cuda(nm, layers[0].device(), ids, buf, to_buf, plan);
}

void gather_pages_cuda(const at::Tensor& kv, const at::Tensor& page_ids, const at::Tensor& out, int64_t skip) {
  pool_cuda(kGatherPages, kv, page_ids, out, skip, /*to_buf=*/true);
}

void scatter_pages_cuda(const at::Tensor& src, const at::Tensor& kv, const at::Tensor& page_ids, int64_t skip) {
  pool_cuda(kScatterPages, kv, page_ids, src, skip, /*to_buf=*/false);
}

void gather_blocks_cuda(at::TensorList layers, const at::Tensor& block_ids, const at::Tensor& out, int64_t skip) {
  blocks_cuda(kGatherBlocks, layers, block_ids, out, skip, /*to_buf=*/true);
}

void scatter_blocks_cuda(const at::Tensor& src, at::TensorList layers, const at::Tensor& block_ids, int64_t skip) {
  blocks_cuda(kScatterBlocks, layers, block_ids, src, skip, /*to_buf=*/false);
}

}  // namespace
}  // namespace radixkv

TORCH_LIBRARY_IMPL(radixkv, CUDA, m) {
  m.impl("gather_pages", &radixkv::gather_pages_cuda);
  m.impl("scatter_pages", &radixkv::scatter_pages_cuda);
  m.impl("gather_blocks", &radixkv::gather_blocks_cuda);
  m.impl("scatter_blocks", &radixkv::scatter_blocks_cuda);
}
