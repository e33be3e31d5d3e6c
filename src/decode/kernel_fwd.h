// The decode forward: split-KV attention for short queries (FlashDecoding).
//
// A CTA per (key split, row tile, kv head, batch) serves 16 of the query rows
// that read its kv head (the group's query heads times the query positions:
// "rows", one mma tile), so each K and V row is read from memory once for all
// of them; with more rows, the tiles' CTAs are adjacent in the grid and read
// the same keys at about the same time, from L2 after the first. The warps take the split's 16-key tiles in turns, each
// with its own online softmax and no barrier:
//   - K and V tiles stream into the warp's shared-memory ring with cp.async,
//     kStages - 1 tiles ahead, so that enough bytes are in flight to keep the
//     memory system busy (the loads never wait on the math);
//   - S = Q K^T and O += P V on tensor cores (mma.sync m16n8k16, fp32
//     accumulators): Q, K and V fragments come from shared memory with
//     ldmatrix, P stays in registers (the scores' accumulator layout is the
//     next mma's operand layout).
// The warps' partial outputs are summed in shared memory at the end, in a
// fixed order. One split writes the output and lse; several write partials
// that combine_kernel merges. With attn_mask (kMasked) the CTA first lists the
// split's tiles one of its rows sees, and the warps take those alone (config.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "common/constants.h"
#include "common/mask.h"
#include "common/mask_values.h"
#include "decode/config.h"
#include "params.h"

namespace tfb::decode {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, or zeros when !valid (src is then not read).
// Past L1 (.cg): a 128-byte line whose chunks land on one aligned line of
// shared memory (config.h's row layout) is one L2 request. At B 8, S 64K (ncu,
// benchmarks/history/2026-11-29-decode-loads.md) the L1-allocating .ca reached
// 81% of DRAM bandwidth; .cg into 16-byte-padded rows, whose lines straddle
// two shared lines, 85% with 2.6 times the L2 requests; .cg into aligned rows
// 94.5%. The zeros are plain stores: the same lane writes the same chunk of a
// stage every tile, and a stage is refilled only after its last copies landed.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  if (valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  } else {
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0));
  }
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  cp_async_16(smem_addr(dst), src, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// d += a b for one m16n8k16 tile, fp32 accumulators.
template <class Element>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as the packed pair of Elements an mma operand register holds.
template <class Element>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Programmatic dependent launch (launch_fwd.h): from sm_90 on, a grid launched
// with programmatic stream serialisation may start while the previous grid in
// its stream still runs. It waits here before it reads or writes memory that
// grid may touch, and lets the next grid start its own launch early.
__device__ __forceinline__ void wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether one of the four bytes of w is zero.
__device__ __forceinline__ bool has_zero_byte(uint32_t w) { return ((w - 0x01010101u) & ~w & 0x80808080u) != 0; }

// Over the keys [key0, min(key0 + kTileKeys, end)) of one mask row (an
// element per key, col_stride bytes apart): whether one is visible (any) and
// one needs its own look (hidden: a boolean 0, an additive value other than 0).
__device__ __forceinline__ void scan_mask_row(const uint8_t* row, int64_t col_stride, MaskValues type, int key0,
                                              int end, bool& any, bool& hidden) {
  const int n = min(kTileKeys, end - key0);
  if (n <= 0) return;
  const uint8_t* keys = row + key0 * col_stride;
  if (type != MaskValues::kBool) {
    mask::with_value_type(type, [&](auto t) {
      for (int j = 0; j < n; ++j) {
        const float v = mask::load_value<decltype(t)::value>(keys + j * col_stride);
        any |= v != -INFINITY;
        hidden |= v != 0.f;
      }
    });
  } else if (col_stride == 1 && n == kTileKeys && reinterpret_cast<uintptr_t>(keys) % 16 == 0) {
    const uint4 x = *reinterpret_cast<const uint4*>(keys);
    any |= (x.x | x.y | x.z | x.w) != 0;
    hidden |= has_zero_byte(x.x) || has_zero_byte(x.y) || has_zero_byte(x.z) || has_zero_byte(x.w);
  } else {
    for (int j = 0; j < n; ++j) {
      const bool visible = keys[j * col_stride] != 0;
      any |= visible;
      hidden |= !visible;
    }
  }
}

// The CTA's shared memory, carved from smem_bytes(kE).
template <int kE>
struct Smem {
  static constexpr int kRowElems = int(smem_row_elems(kE));
  static constexpr int kStages = decode::kStages;
  static constexpr int kTileElems = kTileKeys * kRowElems;
  static constexpr int kQElems = kTileRows * kRowElems;
  static constexpr int kWarpElems = kStages * 2 * kTileElems;  // K and V per stage
  static_assert(size_t(kQElems + kWarps * kWarpElems) * 2 == smem_bytes(kE), "the layout is smem_bytes'");
  // Element offset of 16-byte chunk c of row r (of a tile, or of Q): in an
  // unpadded row, chunk c lies at c ^ (r % 8), so that the eight rows an
  // ldmatrix reads (r to r + 7, one chunk each) fall in different banks.
  static __device__ __forceinline__ int at(int r, int c) {
    return r * kRowElems + (smem_swizzled(kE) ? c ^ (r & 7) : c) * 8;
  }
};

template <class Element, int kE, bool kMasked>
__global__ void __launch_bounds__(kThreads) split_kernel(__grid_constant__ const AttnFwdParams p, const Rows rows,
                                                         const Splits splits) {
  static_assert(kE % 16 == 0 && kE <= 256, "head dims are multiples of 16, at most 256");
  using S = Smem<kE>;
  constexpr int kChunks = kE / 8;      // 16-byte chunks of a row
  constexpr int kNBlocks = kE / 8;     // output columns in 8-wide mma tiles
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Element* const q_smem = reinterpret_cast<Element*>(smem_raw);
  wait_previous_grid();
  let_next_grid_launch();

  const int split = blockIdx.x / rows.tiles(), head_kv = blockIdx.y, batch = blockIdx.z;
  const int row0 = blockIdx.x % rows.tiles() * kTileRows;  // this CTA's first row
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int len_q = p.seqlen_q(batch), len_k = p.seqlen_k(batch);
  const auto band = mask::band_of(p.mask, len_q, len_k);
  const int split_begin = split * splits.chunk;
  const int last_row = min(row0 + kTileRows, rows.count) - 1;
  const int split_end = min(split_begin + splits.chunk, band.key_end(rows.position(last_row)));
  // The warps take the split's tiles in turns (warp w: tiles w, w + kWarps, ...),
  // so that the CTA's loads sweep its keys front to back together.
  const int split_tiles = split_end > split_begin ? (split_end - split_begin + kTileKeys - 1) / kTileKeys : 0;

  // Q: 16 rows, those past the call's zero (their results are dropped).
  for (int i = tid; i < kTileRows * kChunks; i += kThreads) {
    const int r = row0 + i / kChunks, c = i % kChunks;
    const bool valid = r < rows.count && rows.position(r) < len_q;  // a packed batch's shorter sequence: fewer
    const Element* src = static_cast<const Element*>(p.q) + p.q_offset(batch) +
                         (valid ? int64_t(rows.head_q(head_kv, r)) * p.q_head_stride +
                                      int64_t(rows.position(r)) * p.q_row_stride
                                : 0) +
                         c * 8;
    cp_async_16(q_smem + S::at(r - row0, c), src, valid);
  }
  cp_async_commit();

  // The thread's two rows (g, g + 8) of the mma tiles, and its columns' offset.
  const int g = lane / 4, pair = 2 * (lane % 4);
  // Keys past live_end score -inf in the thread's rows: the split's end or the row's causal end.
  const int live_end[2] = {min(split_end, band.key_end(rows.position(row0 + g))),
                           min(split_end, band.key_end(rows.position(row0 + g + 8)))};
  // Row r's mask row; null past the call's rows.
  auto mask_row = [&](int r) -> const uint8_t* {
    if (r >= rows.count) return nullptr;
    return p.mask.values + int64_t(batch) * p.mask.values_batch_stride +
           int64_t(rows.head_q(head_kv, r)) * p.mask.values_head_stride +
           int64_t(rows.position(r)) * p.mask.values_row_stride;
  };
  uint16_t* const list = reinterpret_cast<uint16_t*>(smem_raw + smem_bytes(kE));
  int listed = split_tiles;  // the split's tiles the warps take
  if constexpr (kMasked) {
    // The list, in the split's order (so that every run sums in one order): a
    // round of kThreads tiles at a time, each thread classifying one, the
    // round's live tiles packed by warp ballots.
    int* const warp_live = reinterpret_cast<int*>(list + kMaxListedTiles);
    listed = 0;
    for (int round = 0; round < split_tiles; round += kThreads) {
      const int tile = round + tid;
      bool any = false, hidden = false;
      if (tile < split_tiles) {
        const int key0 = split_begin + tile * kTileKeys;
        for (int r = row0; r <= last_row; ++r) {
          const int end = min(split_end, band.key_end(rows.position(r)));
          scan_mask_row(mask_row(r), p.mask.values_col_stride, p.mask.values_type, key0, end, any, hidden);
        }
      }
      const unsigned live = __ballot_sync(0xffffffffu, any);
      if (lane == 0) warp_live[warp] = __popc(live);
      __syncthreads();
      int slot = listed + __popc(live & ((1u << lane) - 1)), total = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        slot += w < warp ? warp_live[w] : 0;
        total += warp_live[w];
      }
      if (any) list[slot] = uint16_t(tile | (hidden ? kPartlyHidden : 0u));
      listed += total;
      __syncthreads();  // warp_live is rewritten next round; the list is read below
    }
  }
  const int tiles = listed > warp ? (listed - warp + kWarps - 1) / kWarps : 0;
  // The warp's t-th tile: its index in the split, and whether the mask hides part of it.
  auto tile_index = [&](int t) -> int {
    const int i = t * kWarps + warp;
    if constexpr (kMasked) return list[i] & ~kPartlyHidden;
    return i;
  };
  auto tile_key0 = [&](int t) { return split_begin + tile_index(t) * kTileKeys; };

  const Element* k_head = static_cast<const Element*>(p.k) + p.k_offset(batch) + int64_t(head_kv) * p.k_head_stride;
  const Element* v_head = static_cast<const Element*>(p.v) + p.v_offset(batch) + int64_t(head_kv) * p.v_head_stride;
  Element* const ring = q_smem + S::kQElems + warp * S::kWarpElems;
  auto k_tile = [&](int stage) { return ring + stage * 2 * S::kTileElems; };
  auto v_tile = [&](int stage) { return ring + stage * 2 * S::kTileElems + S::kTileElems; };
  // Tile t's 16 K rows and 16 V rows, keys past the split's end as zeros (a
  // zero V row keeps P V finite where P is 0). A lane copies one 16-byte
  // column chunk of every kLoadRows-th row (lanes past kLoadRows * kChunks
  // idle), so that a full tile's loads are copies and pointer steps alone (a
  // lane-strided sweep's per-chunk row arithmetic took 339 of the loop's 563
  // instructions a tile at E 128).
  constexpr int kLoadRows = 32 / kChunks;
  static_assert(kLoadRows >= 1 && kTileKeys % kLoadRows == 0, "a tile is whole passes of the warp");
  const int load_row = lane / kChunks, load_chunk = lane % kChunks, load_col = load_chunk * 8;
  const int64_t k_pass = int64_t(kLoadRows) * p.k_row_stride, v_pass = int64_t(kLoadRows) * p.v_row_stride;
  auto load = [&](int t) {
    if (load_row >= kLoadRows) return;
    const int key0 = tile_key0(t) + load_row;
    // Shared addresses as 32-bit numbers, so that each row's offset is an immediate.
    const uint32_t ks = smem_addr(k_tile(t % S::kStages)), vs = smem_addr(v_tile(t % S::kStages));
    auto dst = [&](int j) { return uint32_t(S::at(load_row + j * kLoadRows, load_chunk) * sizeof(Element)); };
    const Element* kg = k_head + int64_t(key0) * p.k_row_stride + load_col;
    const Element* vg = v_head + int64_t(key0) * p.v_row_stride + load_col;
    if (key0 - load_row + kTileKeys <= split_end) {  // the warp's tile is whole
#pragma unroll
      for (int j = 0; j < kTileKeys / kLoadRows; ++j, kg += k_pass, vg += v_pass) {
        cp_async_16(ks + dst(j), kg, true);
        cp_async_16(vs + dst(j), vg, true);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kTileKeys / kLoadRows; ++j, kg += k_pass, vg += v_pass) {
        const bool valid = key0 + j * kLoadRows < split_end;
        cp_async_16(ks + dst(j), kg, valid);
        cp_async_16(vs + dst(j), vg, valid);
      }
    }
  };
#pragma unroll
  for (int t = 0; t < S::kStages - 1; ++t) {
    if (t < tiles) load(t);
    cp_async_commit();
  }

  float o[kNBlocks][4];
#pragma unroll
  for (int n = 0; n < kNBlocks; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this thread's columns only
  const uint8_t* const my_mask_rows[2] = {kMasked ? mask_row(row0 + g) : nullptr,
                                          kMasked ? mask_row(row0 + g + 8) : nullptr};
  // ldmatrix addresses: lane i names row i % 16 (A) or the matching K/V row,
  // and the first of the two chunks its x4 load covers.
  const int q_row = lane % 16, q_chunk = lane / 16;
  const int k_row = (lane % 8) + (lane / 16) * 8, k_chunk = (lane / 8) % 2;
  const int v_row = (lane % 8) + ((lane / 8) % 2) * 8, v_chunk = lane / 16;

  cp_async_wait<S::kStages - 1>();  // Q's group, the first committed
  __syncthreads();                   // Q came through every warp's lanes

  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<S::kStages - 2>();
    __syncwarp();
    if (t + S::kStages - 1 < tiles) load(t + S::kStages - 1);
    cp_async_commit();
    const Element* ks = k_tile(t % S::kStages);
    const Element* vs = v_tile(t % S::kStages);
    const int key0 = tile_key0(t);

    // What the mask adds to the thread's scaled scores (log2 units: -inf
    // hides, an additive value v gives v log2(e); `replaced`: a value beyond
    // mask_values.h's limit, which takes the score's place), where it hides
    // part of the tile or adds to it; loaded before the products so that
    // their latency hides behind them.
    float bias[2][4] = {};
    uint32_t replaced = 0;  // bit 4h + j
    if constexpr (kMasked) {
      if (list[t * kWarps + warp] & kPartlyHidden) {
        auto read = [&](auto value_of) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int key = key0 + (j / 2) * 8 + pair + j % 2;
              if (my_mask_rows[h] != nullptr && key < split_end) {
                const float v = value_of(my_mask_rows[h] + key * p.mask.values_col_stride);
                bias[h][j] = mask::add_additive(0.f, v, kLog2eFloat);
                replaced |= uint32_t(mask::beyond_limit(v)) << (4 * h + j);
              }
            }
          }
        };
        if (p.mask.values_type == MaskValues::kBool) {
          read([](const uint8_t* at) { return *at == 0 ? -INFINITY : 0.f; });
        } else {
          mask::with_value_type(p.mask.values_type, [&](auto type) {
            read([](const uint8_t* at) { return mask::load_value<decltype(type)::value>(at); });
          });
        }
      }
    }

    // S = Q K^T: two 8-key tiles.
    float s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kE / 16; ++kk) {
      uint32_t a[4], b[4];
      ldmatrix_x4(a, q_smem + S::at(q_row, 2 * kk + q_chunk));
      ldmatrix_x4(b, ks + S::at(k_row, 2 * kk + k_chunk));
      mma<Element>(s[0], a, b[0], b[1]);
      mma<Element>(s[1], a, b[2], b[3]);
    }

    // Online softmax, in log2 units; keys past the split's end or the row's
    // causal end, or hidden by the mask, score -inf.
    float correction[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // row g, then g + 8
      float x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = key0 + (j / 2) * 8 + pair + j % 2;
        const bool live = key < live_end[h] && bias[h][j] != -INFINITY;
        const float score = s[j / 2][2 * h + j % 2];
        const float scaled = replaced >> (4 * h + j) & 1 ? bias[h][j] : fmaf(score, p.scale_log2, bias[h][j]);
        x[j] = live ? scaled : -INFINITY;
      }
      float tile_max = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(m[h], tile_max);
      const float ref = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: weights stay 0
      correction[h] = exp2f(m[h] - ref);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x[j] = exp2f(x[j] - ref);
        sum += x[j];
        s[j / 2][2 * h + j % 2] = x[j];
      }
      l[h] = l[h] * correction[h] + sum;
      m[h] = m_new;
    }
#pragma unroll
    for (int n = 0; n < kNBlocks; ++n) {
      o[n][0] *= correction[0];
      o[n][1] *= correction[0];
      o[n][2] *= correction[1];
      o[n][3] *= correction[1];
    }

    // O += P V: P's accumulator layout is the A operand of one k16 step.
    const uint32_t a[4] = {pack<Element>(s[0][0], s[0][1]), pack<Element>(s[0][2], s[0][3]),
                           pack<Element>(s[1][0], s[1][1]), pack<Element>(s[1][2], s[1][3])};
#pragma unroll
    for (int n = 0; n < kNBlocks; n += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, vs + S::at(v_row, n + v_chunk));
      mma<Element>(o[n], a, b[0], b[1]);
      mma<Element>(o[n + 1], a, b[2], b[3]);
    }
    __syncwarp();  // the next iteration's load overwrites the stage read two tiles from now
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its ring: the merge reuses it

  // The warps' states merged: each warp leaves its rows' max, sum and output
  // in shared memory (a slab per warp, rows padded by 8 floats so that the
  // stores of a warp's lanes fall in different banks), and after one barrier
  // each output element sums the four slabs rescaled to the rows' common max,
  // in warp order, so that every run gives the same bits.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  constexpr int kSlabRow = kE + 8;
  float* const shared_m = reinterpret_cast<float*>(q_smem + S::kQElems);  // [kWarps][kTileRows]
  float* const shared_l = shared_m + kWarps * kTileRows;
  float* const slabs = shared_l + kWarps * kTileRows;  // [kWarps][kTileRows][kSlabRow]
  static_assert(size_t(kWarps) * kTileRows * (2 + kSlabRow) * 4 <= size_t(kWarps * S::kWarpElems) * 2,
                "the merge fits in the rings");
  if (lane % 4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      shared_m[warp * kTileRows + g + 8 * h] = m[h];
      shared_l[warp * kTileRows + g + 8 * h] = l[h];
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (g + 8 * h <= last_row - row0) {  // rows past the call's are dropped
      float* const row = slabs + (warp * kTileRows + g + 8 * h) * kSlabRow + pair;
#pragma unroll
      for (int n = 0; n < kNBlocks; ++n) *reinterpret_cast<float2*>(row + n * 8) = make_float2(o[n][2 * h], o[n][2 * h + 1]);
    }
  }
  __syncthreads();

  for (int i = tid; i < (last_row + 1 - row0) * kE; i += kThreads) {
    const int t = i / kE, c = i % kE, r = row0 + t;
    float m_all = -INFINITY, l_all = 0.f, total = 0.f;
#pragma unroll
    for (int x = 0; x < kWarps; ++x) m_all = fmaxf(m_all, shared_m[x * kTileRows + t]);
#pragma unroll
    for (int x = 0; x < kWarps; ++x) {
      const float mx = shared_m[x * kTileRows + t];
      const float scale = mx == -INFINITY ? 0.f : exp2f(mx - m_all);
      l_all += mx == -INFINITY ? 0.f : shared_l[x * kTileRows + t] * scale;
      total += slabs[(x * kTileRows + t) * kSlabRow + c] * scale;
    }
    // l_all is 0 for a row that sees no key of this split, NaN where a score was.
    const float value = l_all == 0.f ? 0.f : total / l_all;
    const int head_q = rows.head_q(head_kv, r), position = rows.position(r);
    if (position >= len_q) continue;  // past a packed sequence's queries: the next one's rows
    if (splits.count == 1) {
      Element* o_row = static_cast<Element*>(p.o) + p.o_offset(batch) + int64_t(head_q) * p.o_head_stride +
                       int64_t(position) * p.o_row_stride;
      o_row[c] = Element(value);
    } else {
      const int64_t row = (int64_t(split) * p.batch + batch) * p.heads_q * p.len_q + int64_t(head_q) * p.len_q + position;
      p.split_kv.o_partial[row * kE + c] = value;
    }
    if (c == 0) {
      const float lse = l_all == 0.f ? -INFINITY : (m_all + log2f(l_all)) * kLn2Float;
      const int64_t row = (int64_t(batch) * p.heads_q + head_q) * p.len_q + position;
      if (splits.count == 1) {
        p.lse[p.lse_offset(batch, head_q) + position] = lse;
      } else {
        p.split_kv.lse_partial[int64_t(split) * p.batch * p.heads_q * p.len_q + row] = lse;
      }
    }
  }
}

// kCols consecutive floats, global -> shared, in the widest asynchronous
// copies their alignment allows (a row of kE floats starts 16-byte aligned).
template <int kCols>
__device__ __forceinline__ void cp_async_cols(float* dst, const float* src) {
  constexpr int kBytes = kCols * 4 % 16 == 0 ? 16 : kCols * 4 % 8 == 0 ? 8 : 4;
#pragma unroll
  for (int c = 0; c < kCols; c += kBytes / 4) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_addr(dst + c)), "l"(src + c), "n"(kBytes));
  }
}

// Merges the splits' partials: a CTA per (batch, q head, query position) row,
// warp w taking splits w, w + 4, ... in rounds of kBatch, each round's copies
// to shared memory all in flight before the first is read (register loads
// went out one split at a time, ptxas placing each beside its use: a round
// trip to L2 a split). Each weight is taken against the warp's running max
// (one pass: a first pass for the max cost a round trip of its own), then
// the warps' sums are rescaled to the row's max in warp order, so that every
// run gives the same bits. (A warp a row, one dependent load a split at a
// time: the call at B 1, 4 kv heads, S 16K, E 64, 128 splits, took 20.7 us
// against 11.9 with a CTA; benchmarks/history/2026-11-29-decode-small-calls.md
// has the one-pass and staged forms' numbers.)
template <class Element, int kE>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(__grid_constant__ const AttnFwdParams p,
                                                                  const int splits) {
  constexpr int kCols = kE / 32, kCombineWarps = kCombineThreads / 32;
  constexpr int kBatch = kE <= 128 ? 8 : 4;  // splits a warp stages per round: 16 KB of shared memory
  __shared__ __align__(16) float staged[kCombineWarps][kBatch][kE];
  __shared__ float staged_lse[kCombineWarps][kBatch];
  __shared__ float warp_out[kCombineWarps][kE];
  __shared__ float warp_total[kCombineWarps];
  __shared__ float warp_max[kCombineWarps];
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.len_q;
  const int64_t row = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  wait_previous_grid();  // the split kernel's partials
  let_next_grid_launch();
  const float* lse = p.split_kv.lse_partial + row;  // split s at lse[s * rows]
  float m = -INFINITY, total = 0.f, out[kCols] = {};
  for (int first = warp; first < splits; first += kBatch * kCombineWarps) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int s = first + b * kCombineWarps;
      if (s >= splits) break;
      const float* partial = p.split_kv.o_partial + (s * rows + row) * kE + lane * kCols;
      cp_async_cols<kCols>(&staged[warp][b][lane * kCols], partial);
      if (lane == b) cp_async_cols<1>(&staged_lse[warp][b], lse + s * rows);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();  // the lse lanes' copies, seen by every lane
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (first + b * kCombineWarps >= splits) break;
      const float x = staged_lse[warp][b];
      const float m_new = fmaxf(m, x);
      const float ref = m_new == -INFINITY ? 0.f : m_new;  // no split sees a key yet: weights stay 0
      const float keep = expf(m - ref), w = expf(x - ref);
      m = m_new;
      total = fmaf(total, keep, w);
#pragma unroll
      for (int c = 0; c < kCols; ++c) out[c] = fmaf(w, staged[warp][b][lane * kCols + c], out[c] * keep);
    }
    __syncwarp();  // read before the next round's copies
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) warp_out[warp][lane * kCols + c] = out[c];
  if (lane == 0) {
    warp_total[warp] = total;
    warp_max[warp] = m;
  }
  __syncthreads();
  const int position = int(row % p.len_q);
  const int head_q = int((row / p.len_q) % p.heads_q);
  const int batch = int(row / (int64_t(p.len_q) * p.heads_q));
  if (position >= p.seqlen_q(batch)) return;  // past a packed sequence's queries: the next one's rows
  float m_all = -INFINITY;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) m_all = fmaxf(m_all, warp_max[w]);
  const float ref = m_all == -INFINITY ? 0.f : m_all;
  float scale[kCombineWarps];
  total = 0.f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) {
    scale[w] = expf(warp_max[w] - ref);  // 0 for a warp whose splits see no key
    total = fmaf(warp_total[w], scale[w], total);
  }
  Element* o = static_cast<Element*>(p.o) + p.o_offset(batch) + int64_t(head_q) * p.o_head_stride +
               int64_t(position) * p.o_row_stride;
  for (int c = threadIdx.x; c < kE; c += kCombineThreads) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) sum = fmaf(warp_out[w][c], scale[w], sum);
    o[c] = Element(total == 0.f ? 0.f : sum / total);
  }
  if (threadIdx.x == 0) p.lse[p.lse_offset(batch, head_q) + position] = total == 0.f ? -INFINITY : ref + logf(total);
}

}  // namespace tfb::decode
