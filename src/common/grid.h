// Grids of (blocks, heads, batch). CUDA caps gridDim.y and gridDim.z at 65535,
// so heads x batch is one index spread over both: a call with 70000 heads or
// 70000 batches still launches once.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>
#include <cute/config.hpp>

namespace tfb {

struct HeadBatchGrid {
  static constexpr int64_t kMaxYZ = 65535;

  // False when heads x batch exceeds what y and z can hold together.
  static bool fits(int heads, int batch) { return int64_t(heads) * batch <= kMaxYZ * kMaxYZ; }

  static dim3 make(unsigned blocks, int heads, int batch) {
    const int64_t bh = int64_t(heads) * batch;
    const int64_t y = std::max<int64_t>(1, std::min(bh, kMaxYZ));
    return dim3(blocks, unsigned(y), unsigned((bh + y - 1) / y));
  }

  // This CTA's head and batch; false for the surplus CTAs of the last z slice.
  CUTE_DEVICE static bool locate(int heads, int batch, int& head, int& b) {
    const int64_t bh = int64_t(blockIdx.z) * gridDim.y + blockIdx.y;
    if (bh >= int64_t(heads) * batch) return false;
    head = int(bh % heads);
    b = int(bh / heads);
    return true;
  }
};

}  // namespace tfb
