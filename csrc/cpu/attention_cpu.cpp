// CPU impls of the ops: the tiled online-softmax algorithm of the GPU kernels
// (FlashAttention-2 order of work) with float32 accumulation, so that the ops,
// and compiled or exported graphs holding them, run on machines without a GPU.
//
// Every operand tile is copied into a per-thread float buffer, and all six
// products (Q K^T, P V, dO V^T, dS K, dS^T Q, P^T dO) go through one small
// row-major matmul, so the loops that matter are vectorised over a fixed width.
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "checks.h"
#include "common/mask.h"
#include "common/mask_values.h"

// The matmul is the hot loop: build an AVX2/FMA copy beside the baseline one
// and let the loader pick, so one binary is fast where it can be and runs everywhere.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TFB_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define TFB_VECTOR_CLONES
#endif

namespace tfb {
namespace {

// Query rows per parallel task and keys per inner step. With head_dim 256 a
// tile is 64 KiB, so the handful a step touches stays in a core's L2.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;
// Tile rows are padded to a multiple of this many floats (zeros), so the
// matmul's inner loop always has this fixed, register-sized width.
constexpr int64_t kVec = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Row pointers into one (B, H, L, E) tensor with arbitrary strides and a
// contiguous last dim, so strided views are read in place, never copied.
template <typename T>
struct Rows {
  T* data;
  int64_t batch_stride, head_stride, row_stride;

  explicit Rows(const at::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())),
        batch_stride(t.stride(0)),
        head_stride(t.stride(1)),
        row_stride(t.stride(2)) {}

  T* row(int64_t b, int64_t h, int64_t i) const { return data + b * batch_stride + h * head_stride + i * row_stride; }
};

// Rows [r0, r0 + n) of head (b, h) as a float tile with leading dim ld; the
// padding columns are zeroed so they add nothing to a product.
template <typename T>
void load_tile(const Rows<const T>& src, int64_t b, int64_t h, int64_t r0, int64_t n, int64_t e, float* dst,
               int64_t ld) {
  for (int64_t r = 0; r < n; ++r) {
    const T* s = src.row(b, h, r0 + r);
    float* d = dst + r * ld;
    for (int64_t c = 0; c < e; ++c) d[c] = static_cast<float>(s[c]);
    std::fill(d + e, d + ld, 0.f);
  }
}

template <typename T>
void store_tile(const Rows<T>& dst, int64_t b, int64_t h, int64_t r0, int64_t n, int64_t e, const float* src,
                int64_t ld, float factor) {
  for (int64_t r = 0; r < n; ++r) {
    T* d = dst.row(b, h, r0 + r);
    const float* s = src + r * ld;
    for (int64_t c = 0; c < e; ++c) d[c] = static_cast<T>(s[c] * factor);
  }
}

// dst (cols x ld) = src (rows x cols)^T, padding columns of dst zeroed.
void transpose_tile(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float* dst, int64_t ld) {
  for (int64_t c = 0; c < cols; ++c) {
    float* d = dst + c * ld;
    for (int64_t r = 0; r < rows; ++r) d[r] = src[r * ld_src + c];
    std::fill(d + rows, d + ld, 0.f);
  }
}

// Eight floats as one value: vector extensions give the matmul full-width
// registers in each clone (two SSE halves or one AVX register) without
// intrinsics. Left to the auto-vectoriser the same loops ran at 5-20 GFLOP/s
// on a Zen 4 core (it vectorised the k loop as an in-order reduction), these
// at 50-110. aligned(4) because tile rows are only float-aligned.
typedef float Vec8 __attribute__((vector_size(32), aligned(4), may_alias));
constexpr int kVecParts = kVec / 8;

// R rows of C += A B, one kVec-wide column strip at a time held in registers.
// Always inlined: a call would run it with the baseline ISA of its own body
// instead of the ISA of the matmul_acc clone that calls it.
template <int R>
__attribute__((always_inline)) inline void matmul_rows(const float* a, int64_t lda, const float* b, int64_t ldb,
                                                       float* c, int64_t ldc, int64_t n, int64_t k) {
  for (int64_t j = 0; j < n; j += kVec) {
    Vec8 acc[R][kVecParts];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecParts; ++v) acc[r][v] = *reinterpret_cast<const Vec8*>(c + r * ldc + j + 8 * v);
    for (int64_t p = 0; p < k; ++p) {
      Vec8 bp[kVecParts];
      for (int v = 0; v < kVecParts; ++v) bp[v] = *reinterpret_cast<const Vec8*>(b + p * ldb + j + 8 * v);
      for (int r = 0; r < R; ++r) {
        const float ap = a[r * lda + p];
        for (int v = 0; v < kVecParts; ++v) acc[r][v] += ap * bp[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecParts; ++v) *reinterpret_cast<Vec8*>(c + r * ldc + j + 8 * v) = acc[r][v];
  }
}

// C (m x n) += A (m x k) B (k x n), row-major float tiles; n % kVec == 0.
// Three rows of 32 columns are 12 AVX accumulators: the most that leave
// registers for the B row and the broadcast A value.
TFB_VECTOR_CLONES void matmul_acc(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                                  int64_t m, int64_t n, int64_t k) {
  int64_t i = 0;
  for (; i + 3 <= m; i += 3) matmul_rows<3>(a + i * lda, lda, b, ldb, c + i * ldc, ldc, n, k);
  for (; i < m; ++i) matmul_rows<1>(a + i * lda, lda, b, ldb, c + i * ldc, ldc, n, k);
}

// The kernels' band (src/common/mask.h band_of): visible_keys cuts each
// row's keys at its right edge, MaskView::bias hides those left of its left edge.
using Band = tfb::mask::Band;

// The ops' mask arguments' band for this call (checks.h mask_args).
Band band_of(const at::Tensor& values, bool is_causal, bool bottom_right, int64_t window_left, int64_t window_right,
             const AttnShape& s) {
  return tfb::mask::band_of(mask_args(values.defined(), is_causal, bottom_right, window_left, window_right),
                            static_cast<int>(s.len_q), static_cast<int>(s.len_k));
}

// Keys of a block starting at k0 that query row i may see: the block's first
// ones, up to the band's right edge.
int64_t visible_keys(const Band& band, int64_t i, int64_t k0, int64_t block) {
  return std::clamp<int64_t>(band.key_end(static_cast<int>(i)) - k0, 0, block);
}

// attn_mask as check_mask returns it, (B, Hq, L, S) with any strides; off
// when undefined; and the band's left edge. bias(): what a pair adds to its
// scaled score, -inf where it takes no part (left of the band, a boolean
// mask's false, an additive mask's -inf), else 0 or the additive value;
// logit() joins the two as the kernels do (mask_values.h).
struct MaskView {
  const char* data = nullptr;
  at::ScalarType type = at::kBool;
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 0;  // bytes
  Band band;

  MaskView(const at::Tensor& m, const Band& band_) : band(band_) {
    if (!m.defined()) return;
    data = static_cast<const char*>(m.data_ptr());
    type = m.scalar_type();
    const int64_t bytes = m.element_size();
    batch_stride = m.stride(0) * bytes, head_stride = m.stride(1) * bytes;
    row_stride = m.stride(2) * bytes, col_stride = m.stride(3) * bytes;
  }
  // Head (b, h)'s plane: row i, key j at plane + i * row_stride + j * col_stride.
  const char* plane(int64_t b, int64_t h) const { return data ? data + b * batch_stride + h * head_stride : nullptr; }
  float bias(const char* plane, int64_t i, int64_t j) const {
    if (j < band.key_begin(static_cast<int>(i))) return kNegInf;
    if (plane == nullptr) return 0.f;
    const char* at = plane + i * row_stride + j * col_stride;
    switch (type) {
      case at::kBool: return *reinterpret_cast<const bool*>(at) ? 0.f : kNegInf;
      case at::kFloat: return *reinterpret_cast<const float*>(at);
      case at::kHalf: return static_cast<float>(*reinterpret_cast<const at::Half*>(at));
      default: return static_cast<float>(*reinterpret_cast<const at::BFloat16*>(at));
    }
  }
};

// A pair's logit: its scaled score joined by bias (-inf: the pair takes no part).
float logit(float scaled, float bias) {
  return bias == kNegInf ? kNegInf : tfb::mask::add_additive(scaled, bias, 1.f);
}

// A row whose lse is -inf saw no key, so its probabilities must be 0;
// exp(s - inf) gives that where exp(s + inf) would give inf.
float lse_for_exp(float lse) { return lse == kNegInf ? std::numeric_limits<float>::infinity() : lse; }

// One online-softmax step for one query row: turns the raw scores of a key
// block into probabilities against the updated running max and rescales
// what the row accumulated under the old max. Scores at or past `visible` are
// masked, and so are those whose `bias(j)` is -inf; they, like the padding up
// to `width`, become 0. The others gain bias(j) after the scale.
template <class Bias>
void softmax_step(float* s, int64_t visible, int64_t width, float scale, float& row_max, float& row_sum, float* acc,
                  int64_t e, Bias&& bias) {
  float block_max = row_max;
  for (int64_t j = 0; j < visible; ++j) {
    s[j] = logit(s[j] * scale, bias(j));
    block_max = std::max(block_max, s[j]);
  }
  std::fill(s + visible, s + width, 0.f);
  if (block_max == kNegInf) {  // nothing seen yet: keep the row empty
    std::fill(s, s + visible, 0.f);
    return;
  }
  float sum = 0.f;
  for (int64_t j = 0; j < visible; ++j) {
    s[j] = std::exp(s[j] - block_max);
    sum += s[j];
  }
  const float alpha = std::exp(row_max - block_max);  // 0 on the first block (row_max = -inf)
  row_sum = row_sum * alpha + sum;
  row_max = block_max;
  if (alpha != 1.f)
    for (int64_t c = 0; c < e; ++c) acc[c] *= alpha;
}

template <typename T>
void fwd_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                const at::Tensor& lse, const AttnShape& s, float scale, const Band& band, const MaskView& mask) {
  const Rows<const T> Q(q), K(k), V(v);
  const Rows<T> O(out);
  float* lse_data = lse.data_ptr<float>();
  const int64_t E = s.head_dim, Ev = s.head_dim_v, group = s.heads_q / s.heads_kv;
  const int64_t ld = round_up(std::max(E, Ev), kVec);  // columns past a tensor's head dim are zeros
  const int64_t q_blocks = ceil_div(s.len_q, kBlockQ);

  at::parallel_for(0, s.batch * s.heads_q * q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_tile(kBlockQ * ld), k_tile(kBlockK * ld), kt_tile(ld * kBlockK), v_tile(kBlockK * ld);
    std::vector<float> scores(kBlockQ * kBlockK), acc(kBlockQ * ld), row_max(kBlockQ), row_sum(kBlockQ);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (s.heads_q * q_blocks), h = task / q_blocks % s.heads_q;
      const int64_t r0 = task % q_blocks * kBlockQ, rows = std::min(kBlockQ, s.len_q - r0);
      const int64_t hk = h / group;
      const char* plane = mask.plane(b, h);
      load_tile(Q, b, h, r0, rows, E, q_tile.data(), ld);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      // Key blocks past the last row's band are masked for every row here.
      const int64_t k_end = band.key_end(static_cast<int>(r0 + rows - 1));
      for (int64_t k0 = 0; k0 < k_end; k0 += kBlockK) {
        const int64_t cols = std::min(kBlockK, k_end - k0), width = round_up(cols, kVec);
        load_tile(K, b, hk, k0, cols, E, k_tile.data(), ld);
        transpose_tile(k_tile.data(), ld, cols, E, kt_tile.data(), kBlockK);
        load_tile(V, b, hk, k0, cols, Ev, v_tile.data(), ld);
        std::fill(scores.begin(), scores.end(), 0.f);
        matmul_acc(q_tile.data(), ld, kt_tile.data(), kBlockK, scores.data(), kBlockK, rows, width, E);
        for (int64_t i = 0; i < rows; ++i) {
          softmax_step(scores.data() + i * kBlockK, visible_keys(band, r0 + i, k0, cols), width, scale,
                       row_max[i], row_sum[i], acc.data() + i * ld, Ev,
                       [&](int64_t j) { return mask.bias(plane, r0 + i, k0 + j); });
        }
        matmul_acc(scores.data(), kBlockK, v_tile.data(), ld, acc.data(), ld, rows, ld, cols);
      }
      float* lse_row = lse_data + (b * s.heads_q + h) * s.len_q + r0;
      for (int64_t i = 0; i < rows; ++i) {
        // A row the mask hides entirely sums to 0: its output is 0, its lse -inf.
        const float inv = row_sum[i] > 0.f ? 1.f / row_sum[i] : 0.f;
        for (int64_t c = 0; c < Ev; ++c) acc[i * ld + c] *= inv;
        lse_row[i] = row_sum[i] > 0.f ? row_max[i] + std::log(row_sum[i]) : kNegInf;
      }
      store_tile(O, b, h, r0, rows, Ev, acc.data(), ld, 1.f);
    }
  });
}

// D_i = sum_e dO[i, e] O[i, e], the row term of the softmax gradient, (B, Hq, L).
template <typename T>
void bwd_delta(const at::Tensor& grad_out, const at::Tensor& out, float* delta, const AttnShape& s) {
  const Rows<const T> dO(grad_out), O(out);
  at::parallel_for(0, s.batch * s.heads_q, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.heads_q, h = bh % s.heads_q;
      for (int64_t i = 0; i < s.len_q; ++i) {
        const T* g = dO.row(b, h, i);
        const T* o = O.row(b, h, i);
        float d = 0.f;
        for (int64_t c = 0; c < s.head_dim_v; ++c) d += static_cast<float>(g[c]) * static_cast<float>(o[c]);
        delta[bh * s.len_q + i] = d;
      }
    }
  });
}

// dQ = scale * dS K, one task per (batch, q head, query block), over its key blocks.
template <typename T>
void bwd_dq_kernel(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const float* lse, const float* delta, const at::Tensor& dq, const AttnShape& s, float scale,
                   const Band& band, const MaskView& mask) {
  const Rows<const T> dO(grad_out), Q(q), K(k), V(v);
  const Rows<T> dQ(dq);
  const int64_t E = s.head_dim, Ev = s.head_dim_v, group = s.heads_q / s.heads_kv;
  const int64_t ld = round_up(std::max(E, Ev), kVec);  // columns past a tensor's head dim are zeros
  const int64_t q_blocks = ceil_div(s.len_q, kBlockQ);

  at::parallel_for(0, s.batch * s.heads_q * q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_tile(kBlockQ * ld), do_tile(kBlockQ * ld), k_tile(kBlockK * ld), kt_tile(ld * kBlockK);
    std::vector<float> v_tile(kBlockK * ld), vt_tile(ld * kBlockK), scores(kBlockQ * kBlockK);
    std::vector<float> dp(kBlockQ * kBlockK), acc(kBlockQ * ld);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (s.heads_q * q_blocks), h = task / q_blocks % s.heads_q;
      const int64_t r0 = task % q_blocks * kBlockQ, rows = std::min(kBlockQ, s.len_q - r0);
      const int64_t hk = h / group;
      const char* plane = mask.plane(b, h);
      const float* lse_row = lse + (b * s.heads_q + h) * s.len_q + r0;
      const float* delta_row = delta + (b * s.heads_q + h) * s.len_q + r0;
      load_tile(Q, b, h, r0, rows, E, q_tile.data(), ld);
      load_tile(dO, b, h, r0, rows, Ev, do_tile.data(), ld);
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t k_end = band.key_end(static_cast<int>(r0 + rows - 1));
      for (int64_t k0 = 0; k0 < k_end; k0 += kBlockK) {
        const int64_t cols = std::min(kBlockK, k_end - k0), width = round_up(cols, kVec);
        load_tile(K, b, hk, k0, cols, E, k_tile.data(), ld);
        transpose_tile(k_tile.data(), ld, cols, E, kt_tile.data(), kBlockK);
        load_tile(V, b, hk, k0, cols, Ev, v_tile.data(), ld);
        transpose_tile(v_tile.data(), ld, cols, Ev, vt_tile.data(), kBlockK);
        std::fill(scores.begin(), scores.end(), 0.f);
        std::fill(dp.begin(), dp.end(), 0.f);
        matmul_acc(q_tile.data(), ld, kt_tile.data(), kBlockK, scores.data(), kBlockK, rows, width, E);
        matmul_acc(do_tile.data(), ld, vt_tile.data(), kBlockK, dp.data(), kBlockK, rows, width, Ev);
        for (int64_t i = 0; i < rows; ++i) {
          // dS = P * (dP - D), written over the scores.
          float* ds = scores.data() + i * kBlockK;
          const float* dpi = dp.data() + i * kBlockK;
          const float l = lse_for_exp(lse_row[i]), d = delta_row[i];
          const int64_t visible = visible_keys(band, r0 + i, k0, cols);
          for (int64_t j = 0; j < visible; ++j) {
            const float x = logit(ds[j] * scale, mask.bias(plane, r0 + i, k0 + j));
            ds[j] = x == kNegInf ? 0.f : std::exp(x - l) * (dpi[j] - d);
          }
          std::fill(ds + visible, ds + cols, 0.f);
        }
        matmul_acc(scores.data(), kBlockK, k_tile.data(), ld, acc.data(), ld, rows, ld, cols);
      }
      store_tile(dQ, b, h, r0, rows, E, acc.data(), ld, scale);
    }
  });
}

// dK = scale * dS^T Q and dV = P^T dO, one task per (batch, kv head, key
// block) over every query row of the group's q heads: each output row has one
// writer, so there are no atomics and the sums are deterministic.
template <typename T>
void bwd_dkdv_kernel(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const float* lse, const float* delta, const at::Tensor& dk, const at::Tensor& dv,
                     const AttnShape& s, float scale, const Band& band, const MaskView& mask) {
  const Rows<const T> dO(grad_out), Q(q), K(k), V(v);
  const Rows<T> dK(dk), dV(dv);
  const int64_t E = s.head_dim, Ev = s.head_dim_v, group = s.heads_q / s.heads_kv;
  const int64_t ld = round_up(std::max(E, Ev), kVec);  // columns past a tensor's head dim are zeros
  const int64_t k_blocks = ceil_div(s.len_k, kBlockK);

  at::parallel_for(0, s.batch * s.heads_kv * k_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> k_tile(kBlockK * ld), v_tile(kBlockK * ld), q_tile(kBlockQ * ld), qt_tile(ld * kBlockQ);
    std::vector<float> do_tile(kBlockQ * ld), dot_tile(ld * kBlockQ), p(kBlockK * kBlockQ), ds(kBlockK * kBlockQ);
    std::vector<float> dk_acc(kBlockK * ld), dv_acc(kBlockK * ld);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (s.heads_kv * k_blocks), hk = task / k_blocks % s.heads_kv;
      const int64_t k0 = task % k_blocks * kBlockK, cols = std::min(kBlockK, s.len_k - k0);
      load_tile(K, b, hk, k0, cols, E, k_tile.data(), ld);
      load_tile(V, b, hk, k0, cols, Ev, v_tile.data(), ld);
      std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.f);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const float* lse_head = lse + (b * s.heads_q + h) * s.len_q;
        const float* delta_head = delta + (b * s.heads_q + h) * s.len_q;
        const char* plane = mask.plane(b, h);
        // Query rows before the first one that sees this block's first key see none of it.
        for (int64_t r0 = band.row_begin(static_cast<int>(k0)); r0 < s.len_q; r0 += kBlockQ) {
          const int64_t rows = std::min(kBlockQ, s.len_q - r0), width = round_up(rows, kVec);
          load_tile(Q, b, h, r0, rows, E, q_tile.data(), ld);
          transpose_tile(q_tile.data(), ld, rows, E, qt_tile.data(), kBlockQ);
          load_tile(dO, b, h, r0, rows, Ev, do_tile.data(), ld);
          transpose_tile(do_tile.data(), ld, rows, Ev, dot_tile.data(), kBlockQ);
          // Transposed tiles: row j of p is key j against every query row.
          std::fill(p.begin(), p.end(), 0.f);
          std::fill(ds.begin(), ds.end(), 0.f);
          matmul_acc(k_tile.data(), ld, qt_tile.data(), kBlockQ, p.data(), kBlockQ, cols, width, E);
          matmul_acc(v_tile.data(), ld, dot_tile.data(), kBlockQ, ds.data(), kBlockQ, cols, width, Ev);
          for (int64_t j = 0; j < cols; ++j) {
            float* pj = p.data() + j * kBlockQ;
            float* dsj = ds.data() + j * kBlockQ;
            // Rows before row_begin do not see the key.
            const int64_t first = std::clamp<int64_t>(band.row_begin(static_cast<int>(k0 + j)) - r0, 0, rows);
            std::fill(pj, pj + first, 0.f);
            std::fill(dsj, dsj + first, 0.f);
            for (int64_t i = first; i < rows; ++i) {
              const float x = logit(pj[i] * scale, mask.bias(plane, r0 + i, k0 + j));
              pj[i] = x == kNegInf ? 0.f : std::exp(x - lse_for_exp(lse_head[r0 + i]));
              dsj[i] = pj[i] * (dsj[i] - delta_head[r0 + i]);
            }
          }
          matmul_acc(p.data(), kBlockQ, do_tile.data(), ld, dv_acc.data(), ld, cols, ld, rows);
          matmul_acc(ds.data(), kBlockQ, q_tile.data(), ld, dk_acc.data(), ld, cols, ld, rows);
        }
      }
      store_tile(dK, b, hk, k0, cols, E, dk_acc.data(), ld, scale);
      store_tile(dV, b, hk, k0, cols, Ev, dv_acc.data(), ld, 1.f);
    }
  });
}

// Calls f with a value of the C++ element type of dtype.
template <typename F>
void dispatch_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    default:
      TORCH_CHECK(false, "torch_flash_backend CPU kernels take float32, float16 or bfloat16 inputs, got ", dtype);
  }
}

// The CPU's kernels are one family, "cpu"; a family named by the caller must be it.
void check_family(const std::optional<c10::string_view>& family) {
  TORCH_CHECK(!family.has_value() || *family == "cpu", "family='", *family,
              "' cannot run on CPU; the CPU kernels' family is 'cpu'");
}

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           std::optional<double> scale, bool is_causal,
                                           std::optional<c10::string_view> family,
                                           std::optional<c10::string_view> backward_family,
                                           const std::optional<at::Tensor>& attn_mask, bool bottom_right,
                                           int64_t window_left, int64_t window_right) {
  check_family(family);
  check_family(backward_family);
  const AttnShape s = check_qkv(q, k, v);
  const at::Tensor values = check_mask(attn_mask, q, s, softmax_scale(scale, s.head_dim));
  const Band band = band_of(values, is_causal, bottom_right, window_left, window_right, s);
  const MaskView mask(values, band);
  at::Tensor out, lse;
  std::tie(out, lse) = fwd_outputs(q, s);
  if (is_empty_problem(s)) return {out, lse};
  const float sm_scale = static_cast<float>(softmax_scale(scale, s.head_dim));
  dispatch_dtype(q.scalar_type(), [&](auto element) {
    fwd_kernel<decltype(element)>(q, k, v, out, lse, s, sm_scale, band, mask);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& grad_out, const at::Tensor& q,
                                                       const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& out, const at::Tensor& lse,
                                                       std::optional<double> scale, bool is_causal,
                                                       std::optional<c10::string_view> family,
                                                       const std::optional<at::Tensor>& attn_mask, bool bottom_right,
                                                       int64_t window_left, int64_t window_right) {
  check_family(family);
  const AttnShape s = check_qkv(q, k, v);
  check_bwd_extra(grad_out, out, lse, q, s);
  const at::Tensor values = check_mask(attn_mask, q, s, softmax_scale(scale, s.head_dim));
  const Band band = band_of(values, is_causal, bottom_right, window_left, window_right, s);
  const MaskView mask(values, band);
  at::Tensor dq, dk, dv;
  std::tie(dq, dk, dv) = bwd_outputs(q, k, v, s);
  if (is_empty_problem(s)) return {dq, dk, dv};
  const float sm_scale = static_cast<float>(softmax_scale(scale, s.head_dim));
  at::Tensor delta = at::empty({s.batch, s.heads_q, s.len_q}, q.options().dtype(at::kFloat));
  dispatch_dtype(q.scalar_type(), [&](auto element) {
    using T = decltype(element);
    bwd_delta<T>(grad_out, out, delta.data_ptr<float>(), s);
    bwd_dq_kernel<T>(grad_out, q, k, v, lse.data_ptr<float>(), delta.data_ptr<float>(), dq, s, sm_scale, band, mask);
    bwd_dkdv_kernel<T>(grad_out, q, k, v, lse.data_ptr<float>(), delta.data_ptr<float>(), dk, dv, s, sm_scale,
                       band, mask);
  });
  return {dq, dk, dv};
}

// Rows [r0, r0 + n) of a packed (total, H, E) tensor as a (1, H, n, E) batch.
at::Tensor as_batch(const at::Tensor& t, int64_t r0, int64_t n) { return t.narrow(0, r0, n).unsqueeze(0).transpose(1, 2); }

// The packed ops run each sequence as a batch of one through the dense CPU
// kernels (bottom-right aligned, as FlashAttention's varlen causal and
// windows are). Rows no sequence covers, and sequences without keys, give 0
// (lse -inf).
std::tuple<at::Tensor, at::Tensor> varlen_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& cu_seq_q, const at::Tensor& cu_seq_k,
                                                  int64_t max_q, int64_t max_k, std::optional<double> scale,
                                                  bool is_causal, std::optional<c10::string_view> family,
                                                  std::optional<c10::string_view> backward_family,
                                                  int64_t window_left, int64_t window_right,
                                                  const std::optional<at::Tensor>& seqused_k) {
  const VarlenShape s = check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k);
  check_family(family);
  check_family(backward_family);
  mask_args(false, is_causal, true, window_left, window_right);  // the window's checks
  at::Tensor out = at::zeros({s.total_q, s.heads_q, s.head_dim_v}, q.options());
  at::Tensor lse = at::full({s.heads_q, s.total_q}, -std::numeric_limits<float>::infinity(),
                            q.options().dtype(at::kFloat));
  for (const Sequence& seq : check_sequences(s, cu_seq_q, cu_seq_k, seqused_k)) {
    if (seq.len_q == 0 || seq.len_k == 0) continue;
    at::Tensor o, l;
    std::tie(o, l) = fwd_cpu(as_batch(q, seq.q0, seq.len_q), as_batch(k, seq.k0, seq.len_k),
                             as_batch(v, seq.k0, seq.len_k), scale, is_causal, family, backward_family, std::nullopt,
                             true, window_left, window_right);
    as_batch(out, seq.q0, seq.len_q).copy_(o);
    lse.narrow(1, seq.q0, seq.len_q).copy_(l[0]);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seq_q, const at::Tensor& cu_seq_k, int64_t max_q, int64_t max_k,
    std::optional<double> scale, bool is_causal, std::optional<c10::string_view> family, int64_t window_left,
    int64_t window_right, const std::optional<at::Tensor>& seqused_k) {
  const VarlenShape s = check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k);
  check_family(family);
  check_varlen_bwd_extra(s, grad_out, out, lse, q);
  mask_args(false, is_causal, true, window_left, window_right);
  at::Tensor dq = at::zeros_like(q, at::MemoryFormat::Contiguous);
  at::Tensor dk = at::zeros_like(k, at::MemoryFormat::Contiguous);
  at::Tensor dv = at::zeros_like(v, at::MemoryFormat::Contiguous);
  for (const Sequence& seq : check_sequences(s, cu_seq_q, cu_seq_k, seqused_k)) {
    if (seq.len_q == 0 || seq.len_k == 0) continue;
    at::Tensor g_q, g_k, g_v;
    std::tie(g_q, g_k, g_v) =
        bwd_cpu(as_batch(grad_out, seq.q0, seq.len_q), as_batch(q, seq.q0, seq.len_q), as_batch(k, seq.k0, seq.len_k),
                as_batch(v, seq.k0, seq.len_k), as_batch(out, seq.q0, seq.len_q),
                lse.narrow(1, seq.q0, seq.len_q).unsqueeze(0).contiguous(), scale, is_causal, family, std::nullopt,
                true, window_left, window_right);
    as_batch(dq, seq.q0, seq.len_q).copy_(g_q);
    as_batch(dk, seq.k0, seq.len_k).copy_(g_k);
    as_batch(dv, seq.k0, seq.len_k).copy_(g_v);
  }
  return {dq, dk, dv};
}

}  // namespace
}  // namespace tfb

TORCH_LIBRARY_IMPL(torch_flash_backend, CPU, m) {
  m.impl("fwd", &tfb::fwd_cpu);
  m.impl("bwd", &tfb::bwd_cpu);
  m.impl("varlen_fwd", &tfb::varlen_fwd_cpu);
  m.impl("varlen_bwd", &tfb::varlen_bwd_cpu);
}
