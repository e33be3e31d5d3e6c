// The one struct that crosses from the torch binding (csrc/) into the kernels.
// Plain pointers and element strides only: nothing here knows about torch.
#pragma once

#include <cstdint>

namespace tfb {

// Tensors use SDPA's logical layout (batch, head, row, dim) with arbitrary
// strides in elements; the last dim is always contiguous (stride 1).
struct AttnFwdParams {
  const void* q;  // (B, Hq, L, E)
  const void* k;  // (B, Hkv, S, E)
  const void* v;  // (B, Hkv, S, E)
  void* o;        // (B, Hq, L, E)
  float* lse;     // (B, Hq, L), contiguous; natural-log logsumexp of the scaled scores

  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;

  int batch;
  int heads_q;
  int heads_kv;  // heads_q % heads_kv == 0; q head h reads kv head h / (heads_q / heads_kv)
  int len_q;     // L >= 1
  int len_k;     // S >= 1
  int head_dim;  // E (q, k and v share it)

  float scale;       // softmax scale applied to q.k
  float scale_log2;  // scale * log2(e), the kernels using exp2; at least FLT_MIN in magnitude
                     // (masked scores are -inf, and -inf * 0 is NaN)
  bool is_causal;    // top-left aligned: row i sees keys j <= i

  int num_sms;  // of the device the launch targets
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

  // Scratch the caller allocates with bwd_workspace_bytes(); no initial
  // contents are assumed (the kernels clear what they accumulate into).
  void* workspace;

  // dQ summed in a fixed order, so that every run gives the same bits
  // (torch.use_deterministic_algorithms); the workspace grows with it.
  bool deterministic;
};

enum class DType { kFloat16, kBFloat16 };

}  // namespace tfb
