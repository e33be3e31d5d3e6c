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

  // The same grid in groups of `group` (head, batch) pairs, the block slowest
  // within a group: CTAs start in the order of their linear index, so every
  // pair of a group starts block 0 before any starts block 1. Where the low
  // blocks carry the most work (the causal backward's first key tiles), the
  // longest CTAs start first and the short ones fill the tail; groups keep
  // the CTAs that run at once on a few pairs, whose inputs then stay in L2.
  // False for the surplus CTAs of the last z slice.
  CUTE_DEVICE static bool locate_grouped(int heads, int batch, int group, int& block, int& head, int& b) {
    const int64_t bh_count = int64_t(heads) * batch;
    const int64_t linear = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    if (linear >= bh_count * gridDim.x) return false;
    const int64_t per_group = int64_t(group) * gridDim.x;
    const int64_t g = linear / per_group, within = linear % per_group;
    const int64_t pairs = std::min<int64_t>(group, bh_count - g * group);  // the last group may be short
    const int64_t bh = g * group + within % pairs;
    block = int(within / pairs);
    head = int(bh % heads);
    b = int(bh / heads);
    return true;
  }
};

}  // namespace tfb
