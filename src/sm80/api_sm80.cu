// Runtime (dtype, head dim) -> compiled instantiation. A head dim left out of
// the build (TFB_HEAD_DIMS) reports has_* false and never links its symbol.
#include <cutlass/numeric_types.h>

#include "api.h"
#include "sm80/launch.h"

namespace tfb {
namespace sm80 {
namespace {

template <typename Fn>
bool visit_head_dim(int head_dim, Fn&& fn) {
  switch (head_dim) {
#ifdef TFB_WITH_HDIM32
    case 32: fn(std::integral_constant<int, 32>{}); return true;
#endif
#ifdef TFB_WITH_HDIM64
    case 64: fn(std::integral_constant<int, 64>{}); return true;
#endif
#ifdef TFB_WITH_HDIM96
    case 96: fn(std::integral_constant<int, 96>{}); return true;
#endif
#ifdef TFB_WITH_HDIM128
    case 128: fn(std::integral_constant<int, 128>{}); return true;
#endif
#ifdef TFB_WITH_HDIM192
    case 192: fn(std::integral_constant<int, 192>{}); return true;
#endif
#ifdef TFB_WITH_HDIM256
    case 256: fn(std::integral_constant<int, 256>{}); return true;
#endif
    default: return false;
  }
}

template <typename Fn>
bool visit(DType dtype, int head_dim, Fn&& fn) {
  if (dtype == DType::kFloat16) {
    return visit_head_dim(head_dim, [&](auto d) { fn(cutlass::half_t{}, d); });
  }
  return visit_head_dim(head_dim, [&](auto d) { fn(cutlass::bfloat16_t{}, d); });
}

}  // namespace

bool has_fwd(DType dtype, int head_dim) { return visit(dtype, head_dim, [](auto, auto) {}); }
bool has_bwd(DType dtype, int head_dim) { return visit(dtype, head_dim, [](auto, auto) {}); }

cudaError_t run_fwd(const AttnFwdParams& params, DType dtype, cudaStream_t stream) {
  cudaError_t err = cudaErrorNotSupported;
  visit(dtype, params.head_dim, [&](auto element, auto head_dim) {
    err = launch_fwd<decltype(element), decltype(head_dim)::value>(params, stream);
  });
  return err;
}

size_t bwd_workspace_bytes(const AttnBwdParams& params) { return bwd_workspace_bytes_impl(params); }

cudaError_t run_bwd(const AttnBwdParams& params, DType dtype, cudaStream_t stream) {
  cudaError_t err = cudaErrorNotSupported;
  visit(dtype, params.head_dim, [&](auto element, auto head_dim) {
    err = launch_bwd<decltype(element), decltype(head_dim)::value>(params, stream);
  });
  return err;
}

}  // namespace sm80
}  // namespace tfb
