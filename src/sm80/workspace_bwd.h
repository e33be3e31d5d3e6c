// How the backward carves params.workspace. bwd_workspace_bytes_impl (host) and
// the three backward kernels must agree on it, so it lives in one place.
#pragma once

#include <cstddef>
#include <cstdint>

#include "params.h"

namespace tfb::sm80::bwd {

// Query rows are padded to a multiple of the largest kBlockM of any head dim:
// the main kernel then reads row statistics and adds into dq_accum for whole
// query blocks without bounds checks.
constexpr int kRowPad = 128;

inline int padded_len_q(int len_q) { return (len_q + kRowPad - 1) / kRowPad * kRowPad; }

// Per (batch, q head), each array is contiguous over padded query rows.
struct BwdWorkspace {
  float* dq_accum;  // (B, Hq, Lpad, E): scale-free dQ, summed over key blocks with atomics
  float* lse_log2;  // (B, Hq, Lpad): lse * log2(e); +inf on padded rows so their P is 0
  float* dsum;      // (B, Hq, Lpad): rowsum(dO * O); 0 on padded rows
  int len_q_pad;
};

inline size_t bwd_rows_total(const AttnBwdParams& p) {
  return static_cast<size_t>(p.batch) * p.heads_q * padded_len_q(p.len_q);
}

inline size_t bwd_workspace_size(const AttnBwdParams& p) {
  return bwd_rows_total(p) * (static_cast<size_t>(p.head_dim) + 2) * sizeof(float);
}

inline BwdWorkspace carve_workspace(const AttnBwdParams& p) {
  const size_t rows = bwd_rows_total(p);
  float* base = static_cast<float*>(p.workspace);
  return {base, base + rows * p.head_dim, base + rows * (p.head_dim + 1), padded_len_q(p.len_q)};
}

}  // namespace tfb::sm80::bwd
