// The decode forward: split-KV attention for short queries (FlashDecoding).
//
// A CTA per (key split, kv head, batch) serves every query row that reads its
// kv head: the group's query heads times the query positions ("rows", at most
// kRows), so each K and V row is read from memory once for all of them.
// Scores and weights are fp32 on CUDA cores: with a handful of rows a key
// costs a few dozen warp instructions, less than the memory system takes to
// deliver its 4E bytes.
//   1. scores: four lanes per key, each a quarter of the 16-byte chunks of K;
//   2. online softmax per row over the tile (one warp per row);
//   3. P V: each warp a quarter of the tile's keys, each lane E / 32 columns.
// The warps' partial outputs are summed in shared memory at the end, in a
// fixed order. One split
// writes the output and lse; several write partials that combine_kernel merges.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/mask.h"
#include "decode/config.h"
#include "params.h"

namespace tfb::decode {

constexpr float kLn2 = 0.69314718055994531f;

// Elements -> float, n of them from 2-byte-aligned memory, as wide as the
// alignment of n * 2 bytes allows (the caller's offsets are multiples of it).
template <int kN, class Element>
__device__ __forceinline__ void load_floats(const Element* src, float* dst) {
  if constexpr (kN % 8 == 0) {
#pragma unroll
    for (int i = 0; i < kN; i += 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src + i);
      const Element* e = reinterpret_cast<const Element*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[i + j] = float(e[j]);
    }
  } else if constexpr (kN % 4 == 0) {
#pragma unroll
    for (int i = 0; i < kN; i += 4) {
      const uint2 raw = *reinterpret_cast<const uint2*>(src + i);
      const Element* e = reinterpret_cast<const Element*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) dst[i + j] = float(e[j]);
    }
  } else if constexpr (kN % 2 == 0) {
#pragma unroll
    for (int i = 0; i < kN; i += 2) {
      const uint32_t raw = *reinterpret_cast<const uint32_t*>(src + i);
      const Element* e = reinterpret_cast<const Element*>(&raw);
      dst[i] = float(e[0]);
      dst[i + 1] = float(e[1]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) dst[i] = float(src[i]);
  }
}

template <int kE, int kRows>
struct SharedStorage {
  float q[kRows][kE];                // scaled to log2 units; reused to sum the warps' outputs
  float s[kWarps][kRows][32];        // each warp's scores, then weights, of its current 32 keys
  float m[kWarps][kRows], l[kWarps][kRows];
};

template <class Element, int kE, int kRows>
__global__ void __launch_bounds__(kThreads) split_kernel(__grid_constant__ const AttnFwdParams p, const Rows rows,
                                                         const Splits splits) {
  static_assert(kE % 32 == 0 && kE <= 256, "head dims are multiples of 32, at most 256");
  constexpr int kChunks = kE / 8 / kLanesPerKey;  // 16-byte chunks of a K row per lane
  constexpr int kCols = kE / 32;                  // output columns per lane
  constexpr int kKeysPerStep = 32 / kLanesPerKey;
  __shared__ __align__(16) SharedStorage<kE, kRows> shared;

  const int split = blockIdx.x, head_kv = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, sub = lane % kLanesPerKey;
  const int len_q = p.seqlen_q(batch), len_k = p.seqlen_k(batch);
  const auto mask = mask::causal_if(p.is_causal, len_q, len_k);
  const int split_begin = split * splits.chunk;
  const int split_end = min(split_begin + splits.chunk, mask.key_end(len_q - 1));
  // Each warp walks its own quarter of the split, with its own softmax state,
  // so that no barrier stalls the loads; the quarters merge at the end.
  const int quarter = (max(split_end - split_begin, 0) + kWarps - 1) / kWarps;
  const int key_begin = split_begin + warp * quarter;
  const int key_end = min(key_begin + quarter, split_end);

  // Q, scaled so that the scores come out in log2 units; rows past the call's
  // are zero. Every loop below runs all kRows rows with no branch on the count,
  // so that the rows' independent FMA chains interleave (a branch per row
  // serialised them: 0.3 TB/s at 16 rows); the extra rows' results are dropped.
  for (int i = tid; i < kRows * kE; i += kThreads) {
    const int r = i / kE, c = i % kE;
    float value = 0.f;
    if (r < rows.count) {
      const Element* q = static_cast<const Element*>(p.q) + int64_t(batch) * p.q_batch_stride +
                         int64_t(rows.head_q(head_kv, r)) * p.q_head_stride +
                         int64_t(rows.position(r)) * p.q_row_stride;
      value = float(q[c]) * p.scale_log2;
    }
    shared.q[r][c] = value;
  }
  float acc[kRows][kCols];
  float m[kRows], l[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.f;
  }
  const Element* k_head = static_cast<const Element*>(p.k) + int64_t(batch) * p.k_batch_stride +
                          int64_t(head_kv) * p.k_head_stride;
  const Element* v_head = static_cast<const Element*>(p.v) + int64_t(batch) * p.v_batch_stride +
                          int64_t(head_kv) * p.v_head_stride;
  float(*s)[32] = shared.s[warp];
  __syncthreads();

  for (int chunk = key_begin; chunk < key_end; chunk += 32) {
    // 1. Scores of 32 keys: eight a step, four lanes each.
#pragma unroll
    for (int step = 0; step < 32 / kKeysPerStep; ++step) {
      const int local = step * kKeysPerStep + lane / kLanesPerKey;
      const int key = chunk + local;
      const bool live = key < key_end;
      float k[kChunks * 8];
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const uint4 raw = live ? *reinterpret_cast<const uint4*>(k_head + int64_t(key) * p.k_row_stride +
                                                                 (j * kLanesPerKey + sub) * 8)
                               : make_uint4(0, 0, 0, 0);
        const Element* k8 = reinterpret_cast<const Element*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) k[j * 8 + i] = float(k8[i]);
      }
      float dot[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        dot[r] = 0.f;
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          const float4* q4 = reinterpret_cast<const float4*>(&shared.q[r][(j * kLanesPerKey + sub) * 8]);
          const float4 a = q4[0], b = q4[1];
          const float* kj = &k[j * 8];
          dot[r] = fmaf(a.x, kj[0], fmaf(a.y, kj[1], fmaf(a.z, kj[2], fmaf(a.w, kj[3], dot[r]))));
          dot[r] = fmaf(b.x, kj[4], fmaf(b.y, kj[5], fmaf(b.z, kj[6], fmaf(b.w, kj[7], dot[r]))));
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], 1);
        dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], 2);
        if (sub == 0) s[r][local] = live && key < mask.key_end(rows.position(r)) ? dot[r] : -INFINITY;
      }
    }
    __syncwarp();

    // 2. Online softmax over the 32 keys, a lane per key.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float x = s[r][lane];
      float chunk_max = x;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, o));
      const float m_new = fmaxf(m[r], chunk_max);
      const float ref = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet keeps weights 0
      const float w = exp2f(x - ref);
      s[r][lane] = w;
      float sum = w;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float correction = exp2f(m[r] - ref);
      l[r] = l[r] * correction + sum;
      m[r] = m_new;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] *= correction;
    }
    __syncwarp();

    // 3. P V: E / 32 columns a lane.
    const int count = min(32, key_end - chunk);
#pragma unroll 4
    for (int local = 0; local < count; ++local) {
      float v[kCols];
      load_floats<kCols>(v_head + int64_t(chunk + local) * p.v_row_stride + lane * kCols, v);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float w = s[r][local];
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[r][c] = fmaf(w, v[c], acc[r][c]);
      }
    }
    __syncwarp();  // the next chunk overwrites s
  }

  // The warps' states merged: each output rescaled to the rows' common max,
  // then summed in shared memory (Q's buffer, free now) in a fixed order, so
  // that every run gives the same bits.
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows.count) break;
      shared.m[warp][r] = m[r];
      shared.l[warp][r] = l[r];
    }
  }
  __syncthreads();
  float(*sum)[kE] = shared.q;
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r >= rows.count) break;
        float m_all = -INFINITY;
#pragma unroll
        for (int x = 0; x < kWarps; ++x) m_all = fmaxf(m_all, shared.m[x][r]);
        const float scale = m[r] == -INFINITY ? 0.f : exp2f(m[r] - m_all);
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          float& total = sum[r][lane * kCols + c];
          total = w == 0 ? acc[r][c] * scale : total + acc[r][c] * scale;
        }
      }
    }
    __syncthreads();
  }

  for (int i = tid; i < rows.count * kE; i += kThreads) {
    const int r = i / kE, c = i % kE;
    float m_all = -INFINITY, l_all = 0.f;
#pragma unroll
    for (int x = 0; x < kWarps; ++x) m_all = fmaxf(m_all, shared.m[x][r]);
#pragma unroll
    for (int x = 0; x < kWarps; ++x) {
      l_all += shared.m[x][r] == -INFINITY ? 0.f : shared.l[x][r] * exp2f(shared.m[x][r] - m_all);
    }
    // l_all is 0 for a row that sees no key of this split, NaN where a score was.
    const float value = l_all == 0.f ? 0.f : sum[r][c] / l_all;
    const int head_q = rows.head_q(head_kv, r), position = rows.position(r);
    if (splits.count == 1) {
      Element* o = static_cast<Element*>(p.o) + int64_t(batch) * p.o_batch_stride + int64_t(head_q) * p.o_head_stride +
                   int64_t(position) * p.o_row_stride;
      o[c] = Element(value);
    } else {
      const int64_t row = (int64_t(split) * p.batch + batch) * p.heads_q * p.len_q + int64_t(head_q) * p.len_q + position;
      p.split_kv.o_partial[row * kE + c] = value;
    }
    if (c == 0) {
      const float lse = l_all == 0.f ? -INFINITY : (m_all + log2f(l_all)) * kLn2;
      const int64_t row = (int64_t(batch) * p.heads_q + head_q) * p.len_q + position;
      if (splits.count == 1) {
        p.lse[row] = lse;
      } else {
        p.split_kv.lse_partial[int64_t(split) * p.batch * p.heads_q * p.len_q + row] = lse;
      }
    }
  }
}

// Merges the splits' partials: a warp per (batch, q head, query position) row.
template <class Element, int kE>
__global__ void __launch_bounds__(kThreads) combine_kernel(__grid_constant__ const AttnFwdParams p, const int splits) {
  constexpr int kCols = kE / 32;
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.len_q;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float lse_max = -INFINITY;
  for (int s = 0; s < splits; ++s) lse_max = fmaxf(lse_max, p.split_kv.lse_partial[s * rows + row]);
  const float ref = lse_max == -INFINITY ? 0.f : lse_max;
  float total = 0.f, out[kCols] = {};
  for (int s = 0; s < splits; ++s) {
    const float w = expf(p.split_kv.lse_partial[s * rows + row] - ref);
    total += w;
    const float* o = p.split_kv.o_partial + (s * rows + row) * kE + lane * kCols;
#pragma unroll
    for (int c = 0; c < kCols; ++c) out[c] = fmaf(w, o[c], out[c]);
  }
  const int position = int(row % p.len_q);
  const int head_q = int((row / p.len_q) % p.heads_q);
  const int batch = int(row / (int64_t(p.len_q) * p.heads_q));
  Element* o = static_cast<Element*>(p.o) + int64_t(batch) * p.o_batch_stride + int64_t(head_q) * p.o_head_stride +
               int64_t(position) * p.o_row_stride + lane * kCols;
#pragma unroll
  for (int c = 0; c < kCols; ++c) o[c] = Element(total == 0.f ? 0.f : out[c] / total);
  if (lane == 0) p.lse[row] = total == 0.f ? -INFINITY : ref + logf(total);
}

}  // namespace tfb::decode
