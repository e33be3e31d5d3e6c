// Torch-free entry points of the kernel families. The binding in csrc/ fills a
// params struct and calls these on its current stream.
#pragma once

#include <cstddef>
#include <cuda_runtime_api.h>

#include "params.h"

namespace tfb {
namespace sm80 {

// Whether an instantiation for (dtype, head_dim) was compiled into this library.
bool has_fwd(DType dtype, int head_dim);
bool has_bwd(DType dtype, int head_dim);

// Launch on `stream`; return the launch's error (cudaSuccess when queued).
cudaError_t run_fwd(const AttnFwdParams& params, DType dtype, cudaStream_t stream);

// Bytes of scratch the backward needs for these sizes (params.workspace).
size_t bwd_workspace_bytes(const AttnBwdParams& params);
cudaError_t run_bwd(const AttnBwdParams& params, DType dtype, cudaStream_t stream);

}  // namespace sm80

namespace sm90 {

// The Hopper forward (sm_90a: TMA, wgmma, warp specialisation). Head dims
// without an instantiation here are served by sm80.
bool has_fwd(DType dtype, int head_dim);

// Whether these sizes and strides fit the TMA descriptors (16-byte aligned
// pointers and strides); when false, run sm80::run_fwd instead.
bool can_run_fwd(const AttnFwdParams& params);

cudaError_t run_fwd(const AttnFwdParams& params, DType dtype, cudaStream_t stream);

}  // namespace sm90
}  // namespace tfb
