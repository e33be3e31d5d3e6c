// Torch-free entry points of the kernel families. The binding in csrc/ fills a
// params struct and calls these on its current stream.
//
// Every family answers the same four questions for each of its passes P
// (src/registry.py lists them; csrc/cuda/families.cpp tables them):
//   has_P(dtype, head_dim)    an instantiation was compiled into this library
//   can_run_P(params)         it can read these pointers, strides and sizes
//   P_workspace_bytes(params) scratch the caller allocates into params.workspace
//   run_P(params, dtype, s)   launch on stream s; the launch's error
#pragma once

#include <cstddef>
#include <cuda_runtime_api.h>

#include "params.h"

namespace tfb {
namespace sm80 {

// Whether an instantiation for (dtype, head_dim) was compiled into this library.
bool has_fwd(DType dtype, int head_dim);
bool has_bwd(DType dtype, int head_dim);

// Any layout the host's checks let through (16-byte vectors, stride 0 too).
bool can_run_fwd(const AttnFwdParams& params);
bool can_run_bwd(const AttnBwdParams& params);

size_t fwd_workspace_bytes(const AttnFwdParams& params);  // attn_mask's summary (0 without one)
size_t bwd_workspace_bytes(const AttnBwdParams& params);

// Launch on `stream`; return the launch's error (cudaSuccess when queued).
cudaError_t run_fwd(const AttnFwdParams& params, DType dtype, cudaStream_t stream);
cudaError_t run_bwd(const AttnBwdParams& params, DType dtype, cudaStream_t stream);

}  // namespace sm80

namespace sm90 {

// The Hopper forward and backward (sm_90a: TMA, wgmma, warp specialisation).
// Head dims without an instantiation here are served by sm80.
bool has_fwd(DType dtype, int head_dim);
bool has_bwd(DType dtype, int head_dim);

// Whether these sizes and strides fit the TMA descriptors (16-byte aligned
// pointers and strides, none 0) and the lengths are the same for every batch
// (the forward: or a packed batch's offsets); when false, sm80 serves the call.
bool can_run_fwd(const AttnFwdParams& params);
bool can_run_bwd(const AttnBwdParams& params);  // the same for q, k, v and dout

size_t fwd_workspace_bytes(const AttnFwdParams& params);  // attn_mask's summary and the scheduler's counter, or a packed batch's tile list
size_t bwd_workspace_bytes(const AttnBwdParams& params);  // sm80's layout (dQ accumulator, row statistics), attn_mask's summary

cudaError_t run_fwd(const AttnFwdParams& params, DType dtype, cudaStream_t stream);
cudaError_t run_bwd(const AttnBwdParams& params, DType dtype, cudaStream_t stream);

}  // namespace sm90

namespace decode {

// The split-KV forward for short queries: at most 256 query rows per kv head
// (the group's heads times the longest query), lengths per batch too.
bool has_fwd(DType dtype, int head_dim);
bool can_run_fwd(const AttnFwdParams& params);
size_t fwd_workspace_bytes(const AttnFwdParams& params);  // the splits' partial outputs
cudaError_t run_fwd(const AttnFwdParams& params, DType dtype, cudaStream_t stream);

}  // namespace decode
}  // namespace tfb
