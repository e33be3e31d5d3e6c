// What the router asks of the built kernels beyond their names: the shared
// memory a block needs and the tile a mask is read in, per (dtype, head dim).
// Read by csrc/ops.cpp into the records built_kernels() returns.
#pragma once

#include <cstddef>

#include "params.h"

namespace tfb {

// The (query rows, keys) tile whose mask bytes a kernel skips together, the
// rows those of one query head (one kv head's, group-packed, for decode);
// {0, 0} where the family reads no mask or its tile varies per call.
struct TileShape {
  int rows = 0, keys = 0;
};

namespace sm80 {
size_t smem_bytes_fwd(DType dtype, int head_dim);
size_t smem_bytes_bwd(DType dtype, int head_dim);  // the smallest configuration that runs
TileShape tile_fwd(DType dtype, int head_dim);
TileShape tile_bwd(DType dtype, int head_dim);
}  // namespace sm80
namespace sm90 {
size_t smem_bytes_fwd(DType dtype, int head_dim);
size_t smem_bytes_bwd(DType dtype, int head_dim);
TileShape tile_fwd(DType dtype, int head_dim);
TileShape tile_bwd(DType dtype, int head_dim);
}  // namespace sm90
namespace decode {
size_t smem_bytes_fwd(DType dtype, int head_dim);
TileShape tile_fwd(DType dtype, int head_dim);
}  // namespace decode
}  // namespace tfb
