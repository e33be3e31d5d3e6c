// The sm80 family's entry points: every head dim, forward and backward.
#include "api.h"
#include "dispatch.h"
#include "kernel_info.h"
#include "sm80/kernel_traits_bwd.h"
#include "sm80/kernel_traits_fwd.h"
#include "sm80/launch.h"

namespace tfb {
namespace sm80 {
namespace {

template <typename Fn>
bool visit_fwd(DType dtype, int head_dim, Fn&& fn) {
  return visit_instantiation<TFB_SM80_FWD_HEAD_DIMS>(dtype, head_dim, fn);
}

template <typename Fn>
bool visit_bwd(DType dtype, int head_dim, Fn&& fn) {
  return visit_instantiation<TFB_SM80_BWD_HEAD_DIMS>(dtype, head_dim, fn);
}

}  // namespace

bool has_fwd(DType dtype, int head_dim) { return visit_fwd(dtype, head_dim, [](auto, auto) {}); }
bool has_bwd(DType dtype, int head_dim) { return visit_bwd(dtype, head_dim, [](auto, auto) {}); }

size_t smem_bytes_fwd(DType dtype, int head_dim) {
  size_t bytes = 0;
  visit_fwd(dtype, head_dim, [&](auto element, auto d) {
    bytes = FwdConfig<decltype(element), decltype(d)::value>::Traits::kSmemBytes;
  });
  return bytes;
}

size_t smem_bytes_bwd(DType dtype, int head_dim) {
  size_t bytes = 0;
  visit_bwd(dtype, head_dim, [&](auto element, auto d) {
    bytes = bwd::BwdConfig<decltype(element), decltype(d)::value>::SmallSmem::kSmemBytes;
  });
  return bytes;
}

cudaError_t run_fwd(const AttnFwdParams& params, DType dtype, cudaStream_t stream) {
  return launch_instantiation<TFB_SM80_FWD_HEAD_DIMS>(dtype, params.head_dim, [&](auto element, auto head_dim) {
    return launch_fwd<decltype(element), decltype(head_dim)::value>(params, stream);
  });
}

bool can_run_fwd(const AttnFwdParams&) { return true; }
bool can_run_bwd(const AttnBwdParams&) { return true; }

size_t fwd_workspace_bytes(const AttnFwdParams&) { return 0; }
size_t bwd_workspace_bytes(const AttnBwdParams& params) { return bwd_workspace_bytes_impl(params); }

cudaError_t run_bwd(const AttnBwdParams& params, DType dtype, cudaStream_t stream) {
  return launch_instantiation<TFB_SM80_BWD_HEAD_DIMS>(dtype, params.head_dim, [&](auto element, auto head_dim) {
    return launch_bwd<decltype(element), decltype(head_dim)::value>(params, stream);
  });
}

}  // namespace sm80
}  // namespace tfb
