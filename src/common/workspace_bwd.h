// How a backward carves params.workspace: the families' workspace sizes (host)
// and their backward kernels (the shared preprocess, each family's main and
// dQ convert kernels) must agree on it, so it lives in one place.
#pragma once

#include <cstddef>
#include <cstdint>

#include "params.h"

namespace tfb {

// Query rows are padded to a multiple of the largest kBlockM of any head dim:
// the main kernel then reads row statistics and adds into dq_accum for whole
// query blocks without bounds checks.
constexpr int kBwdRowPad = 128;

inline int padded_len_q(int len_q) { return (len_q + kBwdRowPad - 1) / kBwdRowPad * kBwdRowPad; }

// dQ accumulators. By default one, which every key block adds into with
// atomics (their order varies from run to run). Deterministic: one per CTA
// column of the main kernel; CTA x walks key blocks x, x + splits, ... in
// order and alone adds into split x, and the convert kernel sums the splits
// in order. Enough splits to fill the SMs over batch x kv heads, at most 8
// (each costs a float32 copy of dQ).
inline int dq_splits(const AttnBwdParams& p) {
  if (!p.deterministic) return 1;
  const int64_t ctas = int64_t(p.batch) * p.heads_kv;
  const int64_t want = (int64_t(p.num_sms) + ctas - 1) / ctas;
  return int(want < 1 ? 1 : want > 8 ? 8 : want);
}

// Per (batch, q head), each array is contiguous over padded query rows.
struct BwdWorkspace {
  float* dq_accum;  // (splits, B, Hq, Lpad, E): scale-free dQ, summed over key blocks
  float* lse_log2;  // (B, Hq, Lpad): lse * log2(e); +inf on padded rows so their P is 0
  float* dsum;      // (B, Hq, Lpad): rowsum(dO * O); 0 on padded rows
  int len_q_pad;
  int splits;
  int64_t split_elems;  // B * Hq * Lpad * E: from one split to the next
};

inline size_t bwd_rows_total(const AttnBwdParams& p) {
  return static_cast<size_t>(p.batch) * p.heads_q * padded_len_q(p.len_q);
}

inline size_t bwd_workspace_size(const AttnBwdParams& p) {
  const size_t rows = bwd_rows_total(p);
  return (rows * p.head_dim * dq_splits(p) + 2 * rows) * sizeof(float);
}

inline BwdWorkspace carve_bwd_workspace(const AttnBwdParams& p) {
  const size_t rows = bwd_rows_total(p);
  const int splits = dq_splits(p);
  float* base = static_cast<float*>(p.workspace);
  float* stats = base + rows * p.head_dim * splits;
  return {base, stats, stats + rows, padded_len_q(p.len_q), splits, int64_t(rows) * p.head_dim};
}

}  // namespace tfb
