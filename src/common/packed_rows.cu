// common/packed_rows.h: a CTA per sequence clears the rows past what the
// kernels write of it; one more CTA clears the rows before the first sequence
// and after the last.
#include "common/packed_rows.h"

#include <climits>
#include <cmath>

namespace tfb {
namespace {

__device__ void clear_range(const PackedRows& p, int64_t begin, int64_t end) {
  if (begin >= end) return;
  const int64_t words = (end - begin) * p.row_bytes / 4;
  for (int t = 0; t < 3; ++t) {
    if (p.rows[t] == nullptr) continue;
    uint32_t* w = reinterpret_cast<uint32_t*>(static_cast<char*>(p.rows[t]) + begin * p.row_bytes);
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) w[i] = 0u;
  }
  if (p.lse != nullptr) {
    const int64_t n = end - begin;
    for (int64_t i = threadIdx.x; i < n * p.heads; i += blockDim.x) {
      p.lse[(i / n) * p.seqlens.total_q + begin + i % n] = -INFINITY;
    }
  }
}

__global__ void clear_unwritten_rows_kernel(const PackedRows p) {
  const SeqLens& s = p.seqlens;
  const int b = blockIdx.x;
  if (b < p.batch) {
    // Sequence b's rows past its length (clamped to max_len and, for keys, to
    // seqused_k); a sequence without keys, all its query rows (0, lse -inf).
    int64_t begin;
    if (p.keys) {
      begin = s.k_begin(b) + s.k(b, p.max_len);
    } else {
      const bool no_keys = s.cu_k != nullptr && s.k(b, INT_MAX) == 0;
      begin = s.q_begin(b) + (no_keys ? 0 : s.q(b, p.max_len));
    }
    clear_range(p, begin, p.keys ? s.k_end(b) : s.q_end(b));
  } else {
    const int* cu = p.keys ? s.cu_k : s.cu_q;
    const int64_t total = p.keys ? s.total_k : s.total_q;
    const int64_t first = SeqLens::clamp(cu[0], 0, total), last = SeqLens::clamp(cu[p.batch], first, total);
    clear_range(p, 0, first);
    clear_range(p, last, total);
  }
}

}  // namespace

cudaError_t clear_unwritten_rows(const PackedRows& p, cudaStream_t stream) {
  if (p.row_bytes % 4 != 0) return cudaErrorInvalidValue;
  clear_unwritten_rows_kernel<<<p.batch + 1, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace tfb
