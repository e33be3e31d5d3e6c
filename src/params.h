// The one struct that crosses from the torch binding (csrc/) into the kernels.
// Plain pointers and element strides only: nothing here knows about torch.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TFB_PARAMS_HD __host__ __device__ __forceinline__
#else
#define TFB_PARAMS_HD inline
#endif

namespace tfb {

// Tensors use SDPA's logical layout (batch, head, row, dim) with arbitrary
// strides in elements; the last dim is always contiguous (stride 1).
// Optional blocks, each zero (off) unless a feature fills it in: a new feature
// adds a block here and kernels read it through the accessors below, so it
// never forks a kernel's signature. (The kernels read lengths through
// seqlen_q / seqlen_k alone, SeqLens's accessors, which variable lengths fill.)

// Per-batch lengths: a packed variable-length batch (cumulative offsets) or a
// preallocated KV cache in use up to a length per batch.
//
// Offsets are the caller's, read on the device and never checked on the host
// (that would cost a sync per call), so every read clamps them: a wrong value
// (falling, negative, past the packed tensors, a sequence longer than the
// longest the caller named) gives a sequence inside the tensors, perhaps empty
// or overlapping another, never a read or write outside them.
struct SeqLens {
  const int* cu_q = nullptr;    // (B + 1); batch b's query rows are [cu_q[b], cu_q[b + 1])
  const int* cu_k = nullptr;    // (B + 1); the same for keys
  const int* used_k = nullptr;  // (B); keys in use per batch, at most the batch's length
  int64_t total_q = 0;          // with cu_q: the packed q's rows, lse's stride per head
  int64_t total_k = 0;          // with cu_k: the packed k's rows

  TFB_PARAMS_HD static int64_t clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }
  // Batch b's first row and the end of its offsets' range, in the packed tensors.
  TFB_PARAMS_HD int64_t q_begin(int b) const { return clamp(cu_q[b], 0, total_q); }
  TFB_PARAMS_HD int64_t q_end(int b) const { return clamp(cu_q[b + 1], q_begin(b), total_q); }
  TFB_PARAMS_HD int64_t k_begin(int b) const { return clamp(cu_k[b], 0, total_k); }
  TFB_PARAMS_HD int64_t k_end(int b) const { return clamp(cu_k[b + 1], k_begin(b), total_k); }

  // Batch b's lengths, given the params' (longest) len_q / len_k.
  TFB_PARAMS_HD int q(int b, int len_q) const { return cu_q ? int(clamp(q_end(b) - q_begin(b), 0, len_q)) : len_q; }
  TFB_PARAMS_HD int k(int b, int len_k) const {
    const int n = cu_k ? int(clamp(k_end(b) - k_begin(b), 0, len_k)) : len_k;
    return used_k ? int(clamp(used_k[b], 0, n)) : n;
  }
};

// How attn_mask's elements read: a bool per pair (nonzero = visible), or an
// additive float (-inf hides) in one of these types.
enum class MaskValues : uint8_t { kBool = 0, kFloat16 = 1, kBFloat16 = 2, kFloat32 = 3 };

// Which pairs take part (kernels read it through common/mask.h band_of and
// common/mask_summary.h with_policy; launch checks read the mode): every pair; a band of keys around each row's diagonal
// (SDPA's is_causal, causal_lower_right, FlashAttention's window_size); or a
// mask in memory, boolean or additive (values_type), with its tile summary.
enum class MaskMode : uint8_t { kNone = 0, kBand = 1, kBool = 2, kAdditive = 3 };

struct MaskArgs {
  MaskMode mode = MaskMode::kNone;
  // kBand: row i sees keys j with i + d - window_left <= j <= i + d + window_right,
  // -1 opening a side; the diagonal d is 0 (top-left, SDPA's is_causal) or,
  // with bottom_right, len_k - len_q (its last row meets the last key, as
  // causal_lower_right and FlashAttention's windows align). is_causal: (-1, 0).
  int window_left = -1;
  int window_right = -1;
  bool bottom_right = false;
  // kBool / kAdditive: attn_mask, (B, H, L, S) with the strides below in bytes
  // (0 to broadcast): nonzero = visible, or a value added to the scores.
  const uint8_t* values = nullptr;
  int64_t values_batch_stride = 0, values_head_stride = 0, values_row_stride = 0, values_col_stride = 0;
  MaskValues values_type = MaskValues::kBool;
  TFB_PARAMS_HD bool in_memory() const { return mode == MaskMode::kBool || mode == MaskMode::kAdditive; }
  // A band with a right edge: rows further down see keys further right, so
  // their tiles cost more (schedulers start them first).
  TFB_PARAMS_HD bool right_bounded() const { return mode == MaskMode::kBand && window_right >= 0; }
  // Additive values join the unscaled scores as value * values_scale, the
  // inverse of the kernels' scale (scale_log2 / log2(e)), so that the
  // scaled score is scale * q.k + value.
  float values_scale = 1.f;
  // common/mask.h TileKind per (query tile, key tile) of one tile shape, from
  // the pre-pass (common/mask_summary.h) the launcher runs: a (m_blocks,
  // tile_kinds_n_blocks) plane per (batch, head), strides 0 where the mask broadcasts.
  const uint8_t* tile_kinds = nullptr;
  int64_t tile_kinds_batch_stride = 0, tile_kinds_head_stride = 0;
  int tile_kinds_n_blocks = 0;
  int tile_keys = 0;  // the key tile they were made for
  // The same pre-pass's copy of the mask, a bit per (row, key), in words of
  // 64 keys from each key tile's start (common/mask.h FromMemory): planes of
  // rows bits_words words apart (0: one row, a mask the same for every row).
  const uint64_t* bits = nullptr;
  int64_t bits_batch_stride = 0, bits_head_stride = 0;
  int bits_words = 0;
};

// Split-KV (decode): partial outputs and logsumexps per split, merged after.
struct SplitKV {
  int num_splits = 1;
  float* o_partial = nullptr;    // (splits, B, Hq, L, E)
  float* lse_partial = nullptr;  // (splits, B, Hq, L)
};

// FP8 inputs' descales: the float32 factors that turn the stored values back
// into the ones meant, one per (batch, kv head) for each of q, k and v (null:
// 1). The kernels fold q's and k's into the scores' scale and v's into O.
struct Descale {
  const float* ptr = nullptr;
  int64_t batch_stride = 0, head_stride = 0;
  TFB_PARAMS_HD float at(int b, int kv_head) const { return ptr ? ptr[b * batch_stride + kv_head * head_stride] : 1.f; }
};
struct Descales {
  Descale q, k, v;
};

// Dropout on P (SDPA's dropout_p): each (query, key) pair of a (batch, q head)
// is dropped with probability p and the kept ones scaled by 1 / (1 - p);
// common/dropout.h draws the decisions from Philox, keyed by PyTorch's CUDA
// generator. Seed and offset come as values, or (while a CUDA graph is
// captured, and in the backward) from device pointers, as PyTorch's
// PhiloxCudaState carries them; the forward writes the pair it used to
// rng_state, which its backward then reads.
struct DropoutArgs {
  // A pair decides with a kDrawBits-bit draw, so p moves in steps of
  // 1 / kDraws (common/dropout.h: a byte of Philox's output each).
  static constexpr int kDrawBits = 8;
  static constexpr uint32_t kDraws = 1u << kDrawBits;
  uint32_t threshold = 0;  // a pair whose draw is below it is dropped; 0: no dropout
  float keep_scale = 1.f;  // 1 / (1 - p)
  uint64_t seed = 0, offset = 0;
  const int64_t* seed_ptr = nullptr;    // set: seed is *seed_ptr ...
  const int64_t* offset_ptr = nullptr;  // ... and offset *offset_ptr + offset_extra
  uint64_t offset_extra = 0;
  int64_t* rng_state = nullptr;  // the forward writes (seed, offset) here
  TFB_PARAMS_HD bool on() const { return threshold != 0; }
};

struct AttnFwdParams {
  const void* q;  // (B, Hq, L, E)
  const void* k;  // (B, Hkv, S, E)
  const void* v;  // (B, Hkv, S, E)
  void* o;        // (B, Hq, L, E)
  float* lse;     // (B, Hq, L), contiguous, or (Hq, total_q) packed: lse_offset; natural-log logsumexp of the scaled scores

  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;

  int batch;
  int heads_q;
  int heads_kv;  // heads_q % heads_kv == 0; q head h reads kv head h / (heads_q / heads_kv)
  int len_q;     // L >= 1 (the longest batch's with seqlens.cu_q); per batch: seqlen_q(b)
  int len_k;     // S >= 1 (likewise); per batch: seqlen_k(b)
  // The kernel's head dim E: its tiles' columns, for q, k, v and o alike
  // (csrc/cuda/families.cpp serving_head_dim picks the instantiation). The
  // tensors in memory may have fewer: q and k qk_dim columns, v and o (dout,
  // dv) v_dim. Loads zero-fill the columns past them on chip and stores leave
  // them out, so the padded columns add nothing to Q K^T or P V.
  int head_dim;
  int qk_dim, v_dim;  // each <= head_dim
  int element_bytes = 2;  // q, k and v's: 2, or 1 for FP8 (e4m3) inputs, whose O is bfloat16

  float scale;       // softmax scale applied to q.k
  float scale_log2;  // scale * log2(e), the kernels using exp2; at least FLT_MIN in magnitude
                     // (masked scores are -inf, and -inf * 0 is NaN)

  int num_sms;  // of the device the launch targets

  // Scratch of the size the family's <pass>_workspace_bytes() asks (src/api.h),
  // allocated by the caller; no initial contents are assumed (kernels clear
  // what they accumulate into). Null when it asks for none.
  void* workspace;

  SeqLens seqlens;
  MaskArgs mask;
  SplitKV split_kv;
  Descales descales;  // FP8 inputs alone
  DropoutArgs dropout;

  // Batch b's query and key lengths: kernels read lengths through these.
  TFB_PARAMS_HD int seqlen_q(int b) const { return seqlens.q(b, len_q); }
  TFB_PARAMS_HD int seqlen_k(int b) const { return seqlens.k(b, len_k); }
  // Where batch b's first row starts, in elements: at its offset in a packed
  // batch (seqlens.cu_q / cu_k), else b batch strides in.
  TFB_PARAMS_HD int64_t q_offset(int b) const { return seqlens.cu_q ? seqlens.q_begin(b) * q_row_stride : b * q_batch_stride; }
  TFB_PARAMS_HD int64_t o_offset(int b) const { return seqlens.cu_q ? seqlens.q_begin(b) * o_row_stride : b * o_batch_stride; }
  TFB_PARAMS_HD int64_t k_offset(int b) const { return seqlens.cu_k ? seqlens.k_begin(b) * k_row_stride : b * k_batch_stride; }
  TFB_PARAMS_HD int64_t v_offset(int b) const { return seqlens.cu_k ? seqlens.k_begin(b) * v_row_stride : b * v_batch_stride; }
  // lse of batch b, head h, its row 0: (B, Hq, L) contiguous, or (Hq, total_q) for a packed batch.
  TFB_PARAMS_HD int64_t lse_offset(int b, int h) const {
    return seqlens.cu_q ? h * seqlens.total_q + seqlens.q_begin(b) : (int64_t(b) * heads_q + h) * len_q;
  }
};

struct AttnBwdParams : AttnFwdParams {
  const void* dout;  // (B, Hq, L, E)
  void* dq;          // (B, Hq, L, E)
  void* dk;          // (B, Hkv, S, E)
  void* dv;          // (B, Hkv, S, E)
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  int64_t dq_batch_stride, dq_head_stride, dq_row_stride;
  int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_row_stride;

  // Where batch b's first row starts in dout, dq (rows as q's) and dk, dv (as k's).
  TFB_PARAMS_HD int64_t do_offset(int b) const { return seqlens.cu_q ? seqlens.q_begin(b) * do_row_stride : b * do_batch_stride; }
  TFB_PARAMS_HD int64_t dq_offset(int b) const { return seqlens.cu_q ? seqlens.q_begin(b) * dq_row_stride : b * dq_batch_stride; }
  TFB_PARAMS_HD int64_t dk_offset(int b) const { return seqlens.cu_k ? seqlens.k_begin(b) * dk_row_stride : b * dk_batch_stride; }
  TFB_PARAMS_HD int64_t dv_offset(int b) const { return seqlens.cu_k ? seqlens.k_begin(b) * dv_row_stride : b * dv_batch_stride; }

  // dQ summed in a fixed order, so that every run gives the same bits
  // (torch.use_deterministic_algorithms); the workspace grows with it.
  bool deterministic;
};

enum class DType { kFloat16, kBFloat16, kFloat8E4M3 };

}  // namespace tfb
