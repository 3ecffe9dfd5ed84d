// The last step of decoding a lossy chunk (radixkv.core.codec): one layer's quantised codes back to
// KV, in one pass on the CPU, where the Python path takes five (unpack, widen, scale, offset, round).
//
//   radixkv::dequantize(packed, bits, step, reference, group, out) -> ()
//
//   out[s, t, h, d] = code(s, t, h, d) * step[s, h, d] + reference[s, t / group, h, d]
//
// for the layer's `count = sides * tokens * heads * dim` codes in C order.  `packed` holds them as
// radixkv.core.codec._pack writes them: for bits <= 4, code i's low nibble is byte i of the first
// half (codes [0, half)) or the high nibble of byte i - half (codes [half, count)), half =
// ceil(count / 2); for bits 5 and 6, a run of ceil(count / 4) bytes follows with each code's two
// high bits, quarter q = i / run in bits 2q..2q+1 of byte i % run; for bits == 8 the codes are
// plain bytes.  Codes are biased (non-negative): the bias is folded into `reference` by the caller.
// step: float32 [sides, heads * dim]; reference: float32 [sides, groups, heads * dim] with groups =
// ceil(tokens / group); out: a contiguous float16, bfloat16 or float32 [sides, tokens, heads, dim].

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace radixkv {
namespace {

void dequantize_cpu(const at::Tensor& packed, int64_t bits, const at::Tensor& step, const at::Tensor& reference,
                    int64_t group, at::Tensor& out) {
  TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8,
              "dequantize: bits must be 2 to 6 or 8, got ", bits);
  TORCH_CHECK(out.dim() == 4 && out.is_contiguous(), "dequantize: out must be a contiguous [sides, tokens, heads, dim]");
  TORCH_CHECK(out.device().is_cpu() && packed.device().is_cpu() && step.device().is_cpu() &&
                  reference.device().is_cpu(), "dequantize: CPU tensors only");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous(),
              "dequantize: packed must be a contiguous uint8 vector");
  TORCH_CHECK(step.scalar_type() == at::kFloat && reference.scalar_type() == at::kFloat && step.is_contiguous() &&
                  reference.is_contiguous(), "dequantize: step and reference must be contiguous float32");
  TORCH_CHECK(group > 0, "dequantize: group must be positive");
  const int64_t sides = out.size(0), tokens = out.size(1), row = out.size(2) * out.size(3);
  const int64_t count = sides * tokens * row, groups = (tokens + group - 1) / group;
  const int64_t half = (count + 1) / 2, run = (count + 3) / 4;
  const int64_t want = bits == 8 ? count : half + (bits > 4 ? run : 0);
  TORCH_CHECK(packed.numel() == want, "dequantize: ", packed.numel(), " packed bytes for ", count, " codes of ",
              bits, " bits, expected ", want);
  TORCH_CHECK(step.numel() == sides * row, "dequantize: step must be [sides, heads * dim]");
  TORCH_CHECK(reference.numel() == sides * groups * row, "dequantize: reference must be [sides, groups, heads * dim]");

  // The codes, unpacked into one byte each: a few cheap loops the compiler vectorises (every
  // pointer is __restrict__: uint8_t may alias anything, and would otherwise keep them scalar).
  const uint8_t* __restrict__ src = packed.data_ptr<uint8_t>();
  std::vector<uint8_t> codes;
  const uint8_t* code = src;
  if (bits != 8) {
    codes.resize(2 * half);
    uint8_t* __restrict__ low = codes.data();
    uint8_t* __restrict__ high_half = codes.data() + half;
    for (int64_t i = 0; i < half; ++i) low[i] = src[i] & 15;
    for (int64_t i = 0; i < half; ++i) high_half[i] = src[i] >> 4;
    if (bits > 4) {
      const uint8_t* __restrict__ high = src + half;
      for (int q = 0; q < 4; ++q) {
        const int64_t begin = q * run, end = std::min(count, (q + 1) * run);
        uint8_t* __restrict__ c = codes.data() + begin;
        const int shift = 2 * q;
        for (int64_t i = 0; i < end - begin; ++i) c[i] |= ((high[i] >> shift) & 3) << 4;
      }
    }
    code = codes.data();
  }
  const float* st = step.data_ptr<float>();
  const float* ref = reference.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "dequantize", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    for (int64_t s = 0; s < sides; ++s) {
      const float* __restrict__ st_s = st + s * row;
      for (int64_t t = 0; t < tokens; ++t) {
        const float* __restrict__ ref_t = ref + (s * groups + t / group) * row;
        const int64_t base = (s * tokens + t) * row;
        const uint8_t* __restrict__ c = code + base;
        scalar_t* __restrict__ o = dst + base;
        for (int64_t j = 0; j < row; ++j) o[j] = static_cast<scalar_t>(static_cast<float>(c[j]) * st_s[j] + ref_t[j]);
      }
    }
  });
}

}  // namespace
}  // namespace radixkv

TORCH_LIBRARY_FRAGMENT(radixkv, m) {
  m.def("dequantize(Tensor packed, int bits, Tensor step, Tensor reference, int group, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixkv, CPU, m) { m.impl("dequantize", &radixkv::dequantize_cpu); }
