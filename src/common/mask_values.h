// attn_mask's elements as the kernels read them (params.h MaskValues): a
// boolean mask's byte, or an additive mask's value in its own type; and the
// rule for an additive value joining a score, which the CPU ops share (the
// device parts alone need CUDA).
#pragma once

#include <cstdint>

#include "params.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#if defined(__CUDACC__)
#define TFB_MASK_VALUES_HD __host__ __device__ __forceinline__
#else
#define TFB_MASK_VALUES_HD inline
#endif

namespace tfb {
namespace mask {

// An additive value v joins a score x as x + v (in the units of the scaled
// score; `to_x` converts: the kernels add v / scale to unscaled scores, the
// decode kernel v log2(e) to scaled ones in log2 units). A finite value beyond
// +-kAdditiveLimit replaces the score by the limit instead. Float32 SDPA adds
// Hugging Face's finfo.min padding (about -3.4e38 in float32 and bfloat16) to
// a score by losing the score, so a row holding nothing else attends
// uniformly; replaced, it does so here too, and with a logsumexp near 65536
// rather than 3e38 float32 still resolves log(keys), which the backward's
// exp(logit - lse) needs (near 3e38 every weight comes out 1). exp(-65536) is
// 0 in every float type, so elsewhere such keys weigh nothing, as in SDPA.
// float16's finfo.min (-65504) stays within and adds as SDPA adds it. A row
// whose largest logits come from values beyond the limit that float32 does not
// round the score away against (|v| below about 1e9) reads otherwise: SDPA
// weighs such keys by their scores.
constexpr float kAdditiveLimit = 65536.f;

TFB_MASK_VALUES_HD bool beyond_limit(float v) {
  constexpr float kMax = 3.40282347e38f;  // FLT_MAX: -inf, +inf and NaN are not beyond
  return (v < -kAdditiveLimit && v >= -kMax) || (v > kAdditiveLimit && v <= kMax);
}

TFB_MASK_VALUES_HD float add_additive(float x, float v, float to_x) {
  if (beyond_limit(v)) return (v < 0.f ? -kAdditiveLimit : kAdditiveLimit) * to_x;
  return x + v * to_x;
}

// Scales the kernels take with an additive mask: |scale| at least this, so
// that kAdditiveLimit / scale stays finite.
constexpr double kAdditiveMinScale = 1e-30;

#if defined(__CUDACC__)

// An additive mask's element type, as a tag for code compiled per type.
template <MaskValues kType>
struct ValueType {
  static constexpr MaskValues value = kType;
};

// Element `at` of a mask of type kType, as a float (a boolean's 0 / 1).
template <MaskValues kType>
__device__ __forceinline__ float load_value(const uint8_t* at) {
  if constexpr (kType == MaskValues::kFloat32) {
    return __ldg(reinterpret_cast<const float*>(at));
  } else if constexpr (kType == MaskValues::kFloat16) {
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(at))));
  } else if constexpr (kType == MaskValues::kBFloat16) {
    return __uint_as_float(uint32_t(__ldg(reinterpret_cast<const unsigned short*>(at))) << 16);
  } else {
    return __ldg(at) != 0 ? 1.f : 0.f;
  }
}

// Calls f(ValueType<t>{}) for an additive mask's type t (never kBool).
template <class F>
__device__ __forceinline__ void with_value_type(MaskValues t, F&& f) {
  if (t == MaskValues::kFloat32) {
    f(ValueType<MaskValues::kFloat32>{});
  } else if (t == MaskValues::kFloat16) {
    f(ValueType<MaskValues::kFloat16>{});
  } else {
    f(ValueType<MaskValues::kBFloat16>{});
  }
}

#endif  // __CUDACC__

}  // namespace mask
}  // namespace tfb
