// common/dropout_mask.h: a thread per pair.
#include "common/dropout_mask.h"

#include <algorithm>

#include "common/dropout.h"

namespace tfb {
namespace {

__global__ void dropout_keep_mask_kernel(const DropoutArgs a, uint8_t* out, int heads, int len_q, int len_k,
                                         int64_t total) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(idx % len_k);
    const int i = int((idx / len_k) % len_q);
    const int64_t bh = idx / (int64_t(len_k) * len_q);
    const Dropout d = Dropout::of(a, int(bh / heads), int(bh % heads), heads);
    const uint4 w = d.draw(Dropout::cell_row(i), Dropout::cell_col(j));
    const int s = Dropout::word_of(i, j);
    const uint32_t word = s == 0 ? w.x : s == 1 ? w.y : s == 2 ? w.z : w.w;
    out[idx] = d.kept_halves(word >> (8 * Dropout::byte_of(j)), Dropout::kLowPair) & 1u;  // the kernels' compare
  }
}

}  // namespace

cudaError_t dropout_keep_mask(const DropoutArgs& a, uint8_t* out, int batch, int heads, int len_q, int len_k,
                              cudaStream_t stream) {
  const int64_t total = int64_t(batch) * heads * len_q * len_k;
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 65535);
  dropout_keep_mask_kernel<<<int(blocks), threads, 0, stream>>>(a, out, heads, len_q, len_k, total);
  return cudaGetLastError();
}

}  // namespace tfb
