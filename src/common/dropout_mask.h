// The pairs a call's dropout kept, as a tensor (the ops' debug mask): the
// rule of common/dropout.h evaluated per pair, apart from any attention.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "params.h"

namespace tfb {

// out: (batch, heads, len_q, len_k) contiguous bytes, 1 where the pair is kept.
// `a` names the seed and offset as the call's backward does (rng_state).
cudaError_t dropout_keep_mask(const DropoutArgs& a, uint8_t* out, int batch, int heads, int len_q, int len_k,
                              cudaStream_t stream);

}  // namespace tfb
