// The sm80 family's entry points: every head dim, forward and backward.
#include "api.h"
#include "dispatch.h"
#include "sm80/launch.h"

namespace tfb {
namespace sm80 {
namespace {

template <typename Fn>
bool visit(DType dtype, int head_dim, Fn&& fn) {
  return visit_instantiation<32, 64, 96, 128, 192, 256>(dtype, head_dim, fn);
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
