// What the router asks of the built kernels beyond their names: the shared
// memory a block needs, per (dtype, head dim). Read by csrc/ops.cpp into the
// records built_kernels() returns.
#pragma once

#include <cstddef>

#include "params.h"

namespace tfb {
namespace sm80 {
size_t smem_bytes_fwd(DType dtype, int head_dim);
size_t smem_bytes_bwd(DType dtype, int head_dim);  // the smallest configuration that runs
}  // namespace sm80
namespace sm90 {
size_t smem_bytes_fwd(DType dtype, int head_dim);
size_t smem_bytes_bwd(DType dtype, int head_dim);
}  // namespace sm90
namespace decode {
size_t smem_bytes_fwd(DType dtype, int head_dim);
}  // namespace decode
}  // namespace tfb
