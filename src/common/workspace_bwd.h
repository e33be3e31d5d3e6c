// How a backward carves params.workspace: the families' workspace sizes (host)
// and their backward kernels (the shared preprocess, each family's main and
// dQ convert kernels) must agree on it, so it lives in one place.
#pragma once

#include <cstddef>
#include <cstdint>

#include "params.h"
#include "common/grid.h"

namespace tfb {

// Query rows are padded to a multiple of the largest kBlockM of any head dim:
// the main kernel then reads row statistics and adds into dq_accum for whole
// query blocks without bounds checks.
constexpr int kBwdRowPad = 128;

TFB_PARAMS_HD int padded_len_q(int len_q) { return (len_q + kBwdRowPad - 1) / kBwdRowPad * kBwdRowPad; }

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

// Rows of the per-row arrays. Uniform lengths: (B, Hq, Lpad), Lpad the padded
// len_q. A packed batch (seqlens.cu_q): (Hq, rows) per head, sequence b from
// row packed_row0(b), its rows padded as above: a sequence's padded rows
// never reach the next one's, and the arrays grow with total_q + B * pad, not
// with B * the longest sequence. (With offsets that are wrong, clamped as
// SeqLens reads them, sequences may overlap but stay inside the arrays.)
TFB_PARAMS_HD int64_t packed_row0(const SeqLens& s, int b) {
  return (s.q_begin(b) + int64_t(b) * kBwdRowPad) / kBwdRowPad * kBwdRowPad;
}

inline int64_t packed_head_rows(const AttnBwdParams& p) {
  return (p.seqlens.total_q + kBwdRowPad - 1) / kBwdRowPad * kBwdRowPad + int64_t(p.batch) * kBwdRowPad;
}

// Per (batch, q head), each array is contiguous over its padded query rows.
struct BwdWorkspace {
  float* dq_accum;  // (splits, rows, E): scale-free dQ, summed over key blocks
  float* lse_log2;  // (rows): lse * log2(e); +inf on padded rows so their P is 0
  float* dsum;      // (rows): rowsum(dO * O); 0 on padded rows
  int len_q_pad;    // uniform lengths: rows per (batch, head)
  int splits;
  int64_t split_elems;  // rows * E: from one split to the next
  SeqLens seqlens;      // a packed batch's (seqlens.cu_q set), else none
  int64_t head_rows;    // a packed batch: rows per head

  // Index of (batch, head)'s first row; its rows follow it. The next head's
  // first row is head_stride() further on.
  TFB_PARAMS_HD int64_t row0(int batch, int head, int heads_q) const {
    return seqlens.cu_q ? head * head_rows + packed_row0(seqlens, batch)
                        : (int64_t(batch) * heads_q + head) * len_q_pad;
  }
  TFB_PARAMS_HD int64_t head_stride() const { return seqlens.cu_q ? head_rows : len_q_pad; }
};

// The grid of a kernel that walks each head's query rows in blocks of kRows
// (the preprocess, the dQ converts): uniform lengths, (blocks of the longest
// sequence, q heads, batch); a packed batch, (blocks of a head's workspace
// rows, q heads): a grid over the longest sequence for every sequence was
// mostly CTAs that return at once (one 32K document among 108 short ones:
// 1.8M CTAs, 1.2 ms in each of the two kernels).
inline dim3 row_blocks_grid(const AttnBwdParams& p, int rows, int64_t uniform_blocks) {
  if (p.seqlens.cu_q) return HeadBatchGrid::make(unsigned(packed_head_rows(p) / rows), p.heads_q, 1);
  return HeadBatchGrid::make(unsigned(uniform_blocks), p.heads_q, p.batch);
}

// row_blocks_grid's CTA: its q head, sequence and first row there; false for
// none (rows between a packed batch's sequences, the last z slice's surplus).
// A packed batch's sequence is the last whose workspace rows start at or
// before the block's (packed_row0 grows with b; with wrong offsets the row
// found still lies inside the arrays).
template <int kRows>
CUTE_DEVICE bool locate_row_block(const AttnBwdParams& p, int& head, int& batch, int& row0) {
  static_assert(kBwdRowPad % kRows == 0, "a block never straddles two sequences' rows");
  if (!p.seqlens.cu_q) {
    row0 = int(blockIdx.x) * kRows;
    return HeadBatchGrid::locate(p.heads_q, p.batch, head, batch);
  }
  int unused;
  if (!HeadBatchGrid::locate(p.heads_q, 1, head, unused)) return false;
  const int64_t row = int64_t(blockIdx.x) * kRows;
  int lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (packed_row0(p.seqlens, mid) <= row) lo = mid; else hi = mid - 1;
  }
  batch = lo;
  const int64_t within = row - packed_row0(p.seqlens, lo);
  row0 = int(within);
  return within >= 0 && within < padded_len_q(p.seqlen_q(lo));
}

inline size_t bwd_rows_total(const AttnBwdParams& p) {
  if (p.seqlens.cu_q) return static_cast<size_t>(p.heads_q) * packed_head_rows(p);
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
  const int64_t head_rows = p.seqlens.cu_q ? packed_head_rows(p) : 0;
  return {base, stats, stats + rows, padded_len_q(p.len_q), splits, int64_t(rows) * p.head_dim, p.seqlens, head_rows};
}

}  // namespace tfb
