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
}  // namespace tfb
