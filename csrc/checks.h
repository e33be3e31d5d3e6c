// Argument checks and output allocation shared by the CPU and CUDA impls, so
// both backends reject the same inputs with the same messages.
#pragma once

#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "common/mask.h"
#include "common/mask_values.h"

namespace tfb {

// Sizes of one attention call, read from SDPA-layout (B, H, L, E) inputs.
struct AttnShape {
  int64_t batch, heads_q, heads_kv, len_q, len_k, head_dim;
  int64_t head_dim_v;  // v's and out's: may differ from q's and k's (e.g. 192 / 128 in latent attention)
};

inline void check_4d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), name, " must be a defined tensor");
  TORCH_CHECK(!t.is_nested(), name, " is a nested tensor; only dense (B, H, L, E) tensors are supported");
  TORCH_CHECK(t.layout() == at::kStrided, name, " must be a strided tensor, got layout ", t.layout());
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D (batch, heads, length, head_dim), got ", t.dim(), "-D with shape ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, name, " must be contiguous in its last dim (stride(-1) == 1), got strides ", t.strides());
}

inline void check_same(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.device() == q.device(), name, " is on ", t.device(), " but q is on ", q.device(), "; all inputs must share one device");
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), name, " has dtype ", t.scalar_type(), " but q has ", q.scalar_type(), "; all inputs must share one dtype");
}

// Checks q, k, v against each other and returns the call's sizes.
inline AttnShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_4d(q, "q");
  check_4d(k, "k");
  check_4d(v, "v");
  check_same(k, "k", q);
  check_same(v, "v", q);
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0),
              "batch sizes differ: q ", q.size(0), ", k ", k.size(0), ", v ", v.size(0));
  TORCH_CHECK(k.size(3) == q.size(3), "k head_dim (", k.size(3), ") must equal q head_dim (", q.size(3), ")");
  TORCH_CHECK(k.size(1) == v.size(1), "k has ", k.size(1), " heads but v has ", v.size(1));
  TORCH_CHECK(k.size(2) == v.size(2), "k has length ", k.size(2), " but v has length ", v.size(2));
  const int64_t hq = q.size(1), hkv = k.size(1);
  TORCH_CHECK(hkv > 0 ? hq % hkv == 0 : hq == 0,
              "q heads (", hq, ") must be a multiple of k/v heads (", hkv, ") for grouped-query attention");
  return {q.size(0), hq, hkv, q.size(2), k.size(2), q.size(3), v.size(3)};
}

// Checks the extra inputs of the backward against the forward's shape.
inline void check_bwd_extra(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                            const at::Tensor& q, const AttnShape& s) {
  check_4d(grad_out, "grad_out");
  check_4d(out, "out");
  check_same(grad_out, "grad_out", q);
  check_same(out, "out", q);
  const std::array<int64_t, 4> want{s.batch, s.heads_q, s.len_q, s.head_dim_v};  // q's, with v's head dim
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(want), "grad_out shape ", grad_out.sizes(),
              " must be (batch, q heads, L, v head_dim) = ", at::IntArrayRef(want));
  TORCH_CHECK(out.sizes() == at::IntArrayRef(want), "out shape ", out.sizes(),
              " must be (batch, q heads, L, v head_dim) = ", at::IntArrayRef(want));
  TORCH_CHECK(lse.defined() && lse.scalar_type() == at::kFloat, "lse must be a float32 tensor");
  TORCH_CHECK(lse.device() == q.device(), "lse is on ", lse.device(), " but q is on ", q.device());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == s.batch && lse.size(1) == s.heads_q && lse.size(2) == s.len_q,
              "lse must have shape (", s.batch, ", ", s.heads_q, ", ", s.len_q, "), got ", lse.sizes());
  TORCH_CHECK(lse.is_contiguous(), "lse must be contiguous (as fwd returns it)");
}

// attn_mask as SDPA takes it (broadcastable to (B, Hq, L, S)): boolean (True
// = take part) or additive (added to the scaled scores; -inf hides) in q's
// dtype or float32, returned as that 4-D view: expanded, never copied, stride 0
// where it broadcasts. Undefined when there is no mask. An additive mask needs
// |scale| >= kAdditiveMinScale: the kernels add value / scale to the unscaled scores.
inline at::Tensor check_mask(const std::optional<at::Tensor>& attn_mask, const at::Tensor& q, const AttnShape& s,
                             double scale) {
  if (!attn_mask.has_value() || !attn_mask->defined()) return {};
  const at::Tensor& m = *attn_mask;
  const bool additive = m.scalar_type() != at::kBool;
  TORCH_CHECK(!additive || m.scalar_type() == q.scalar_type() || m.scalar_type() == at::kFloat,
              "attn_mask must be a bool tensor (True = take part) or an additive mask in q's dtype (",
              q.scalar_type(), ") or float32, got ", m.scalar_type());
  TORCH_CHECK(!additive || std::abs(scale) >= tfb::mask::kAdditiveMinScale,
              "an additive attn_mask needs |scale| >= ", tfb::mask::kAdditiveMinScale, ", got scale=", scale);
  TORCH_CHECK(m.device() == q.device(), "attn_mask is on ", m.device(), " but q is on ", q.device());
  TORCH_CHECK(m.layout() == at::kStrided && !m.is_nested(), "attn_mask must be a strided tensor");
  const std::array<int64_t, 4> full{s.batch, s.heads_q, s.len_q, s.len_k};
  TORCH_CHECK(m.dim() <= 4, "attn_mask must have at most 4 dims, got shape ", m.sizes());
  for (int64_t d = 1; d <= m.dim(); ++d) {
    const int64_t size = m.size(-d), want = full[4 - d];
    TORCH_CHECK(size == want || size == 1, "attn_mask of shape ", m.sizes(), " does not broadcast to (batch, heads, L, S) = (",
                full[0], ", ", full[1], ", ", full[2], ", ", full[3], ")");
  }
  return m.expand({full[0], full[1], full[2], full[3]});
}

// The ops' mask arguments as the kernels' one mask mode (src/params.h
// MaskArgs): attn_mask's (boolean or additive, fill_mask's), else a band
// where is_causal or a window asks for one. is_causal closes the right edge
// at the diagonal; window_left / window_right (FlashAttention's window_size)
// bound each side, -1 leaving it open; bottom_right puts the diagonal at the
// last key. A band is not combined with attn_mask (SDPA refuses is_causal
// with one too).
inline MaskArgs mask_args(bool has_mask, bool is_causal, bool bottom_right, int64_t window_left,
                          int64_t window_right) {
  TORCH_CHECK(window_left >= -1 && window_left < tfb::mask::kUnbounded,
              "window_left must be -1 (no left edge) or a number of keys >= 0, got ", window_left);
  TORCH_CHECK(window_right >= -1 && window_right < tfb::mask::kUnbounded,
              "window_right must be -1 (no right edge) or a number of keys >= 0, got ", window_right);
  const bool window = window_left >= 0 || window_right >= 0;
  TORCH_CHECK(!has_mask || !(is_causal || window), "attn_mask cannot be combined with ",
              is_causal ? "is_causal=True" : "a window (window_left / window_right)",
              "; fold the band into the mask instead");
  MaskArgs m;
  if (!is_causal && !window) return m;
  m.mode = MaskMode::kBand;
  m.window_left = static_cast<int>(window_left);
  m.window_right = is_causal ? 0 : static_cast<int>(window_right);
  m.bottom_right = bottom_right;
  return m;
}

inline double softmax_scale(std::optional<double> scale, int64_t head_dim) {
  if (scale.has_value()) return *scale;
  return head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
}

// (B, H, L, E) view of a tensor laid out as (B, L, H, E) in memory: see ops.cpp.
inline at::Tensor empty_blhe(int64_t b, int64_t h, int64_t l, int64_t e, const at::TensorOptions& opts) {
  return at::empty({b, l, h, e}, opts).transpose(1, 2);
}

inline bool is_empty_problem(const AttnShape& s) {
  return s.batch == 0 || s.heads_q == 0 || s.len_q == 0 || s.len_k == 0;
}

// fwd's (out, lse). For an empty problem they are already the answer: with no
// keys an empty softmax contributes nothing (as PyTorch's math path gives).
inline std::tuple<at::Tensor, at::Tensor> fwd_outputs(const at::Tensor& q, const AttnShape& s) {
  at::Tensor out = empty_blhe(s.batch, s.heads_q, s.len_q, s.head_dim_v, q.options());
  at::Tensor lse = at::empty({s.batch, s.heads_q, s.len_q}, q.options().dtype(at::kFloat));
  if (is_empty_problem(s)) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
  }
  return {out, lse};
}

// bwd's (dq, dk, dv); zeros for an empty problem.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_outputs(const at::Tensor& q, const at::Tensor& k,
                                                                  const at::Tensor& v, const AttnShape& s) {
  at::Tensor dq = empty_blhe(s.batch, s.heads_q, s.len_q, s.head_dim, q.options());
  at::Tensor dk = empty_blhe(s.batch, s.heads_kv, s.len_k, s.head_dim, k.options());
  at::Tensor dv = empty_blhe(s.batch, s.heads_kv, s.len_k, s.head_dim_v, v.options());
  if (is_empty_problem(s)) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  return {dq, dk, dv};
}

// Sizes of a packed variable-length call: q (total_q, Hq, E), k (total_k,
// Hkv, E) and v (total_k, Hkv, E_v), batch sequences of cu_seq_q / cu_seq_k's offsets.
struct VarlenShape {
  int64_t batch, total_q, total_k, heads_q, heads_kv, head_dim, max_q, max_k;
  int64_t head_dim_v;
};

inline void check_offsets(const at::Tensor& t, const char* name, const at::Tensor& q, int64_t numel) {
  TORCH_CHECK(t.defined() && t.scalar_type() == at::kInt, name, " must be an int32 tensor, got ",
              t.defined() ? c10::toString(t.scalar_type()) : "undefined");
  TORCH_CHECK(t.device() == q.device(), name, " is on ", t.device(), " but q is on ", q.device());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), name, " must be a contiguous 1-D tensor, got shape ", t.sizes());
  TORCH_CHECK(numel < 0 || t.numel() == numel, name, " must have ", numel, " elements, got ", t.numel());
}

// An optional tensor argument, or null when it is absent or undefined.
inline const at::Tensor* present(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

// The packed call's metadata, checked on the host without reading the
// offsets (a device tensor's values would cost a sync): sequence b's query
// rows are [cu_seq_q[b], cu_seq_q[b + 1]), its keys start at cu_seq_k[b] and
// number seqused_k[b] if given, else cu_seq_k[b + 1] - cu_seq_k[b].
inline VarlenShape check_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& cu_seq_q, const at::Tensor& cu_seq_k, int64_t max_q,
                                int64_t max_k, const std::optional<at::Tensor>& seqused_k) {
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    TORCH_CHECK(t->defined() && t->layout() == at::kStrided && !t->is_nested(), name, " must be a strided tensor");
    TORCH_CHECK(t->dim() == 3, name, " must be 3-D (total tokens, heads, head_dim) for a packed batch, got shape ",
                t->sizes());
    TORCH_CHECK(t->stride(-1) == 1 || t->size(-1) <= 1, name, " must be contiguous in its last dim, got strides ",
                t->strides());
  }
  check_same(k, "k", q);
  check_same(v, "v", q);
  TORCH_CHECK(k.size(2) == q.size(2), "k head_dim (", k.size(2), ") must equal q head_dim (", q.size(2), ")");
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1), "v shape ", v.sizes(), " must match k shape ",
              k.sizes(), " but for its head dim");
  const int64_t hq = q.size(1), hkv = k.size(1);
  TORCH_CHECK(hkv > 0 ? hq % hkv == 0 : hq == 0,
              "q heads (", hq, ") must be a multiple of k/v heads (", hkv, ") for grouped-query attention");
  check_offsets(cu_seq_q, "cu_seq_q", q, -1);
  TORCH_CHECK(cu_seq_q.numel() >= 1, "cu_seq_q must hold batch + 1 offsets, got none");
  check_offsets(cu_seq_k, "cu_seq_k", q, cu_seq_q.numel());
  const int64_t batch = cu_seq_q.numel() - 1;
  if (const at::Tensor* used = present(seqused_k)) check_offsets(*used, "seqused_k", q, batch);
  TORCH_CHECK(max_q >= 0 && max_q <= q.size(0), "max_q must lie in [0, total query tokens ", q.size(0), "], got ",
              max_q);
  TORCH_CHECK(max_k >= 0 && max_k <= k.size(0), "max_k must lie in [0, total key tokens ", k.size(0), "], got ",
              max_k);
  return {batch, q.size(0), k.size(0), hq, hkv, q.size(2), max_q, max_k, v.size(2)};
}

// A packed batch's sequence b: query rows [q0, q0 + len_q), keys [k0, k0 + len_k).
struct Sequence {
  int64_t q0, len_q, k0, len_k;
};

// The offsets' values, read on the host (the CPU ops': the CUDA ops leave them
// on the device, where the kernels clamp what they read, params.h SeqLens),
// checked: each sequence inside the packed tensors, rising, within max_q /
// max_k, seqused_k within its sequence's keys.
inline std::vector<Sequence> check_sequences(const VarlenShape& s, const at::Tensor& cu_seq_q,
                                             const at::Tensor& cu_seq_k, const std::optional<at::Tensor>& seqused_k) {
  const at::Tensor host_q = cu_seq_q.cpu(), host_k = cu_seq_k.cpu();
  const at::Tensor* used_k = present(seqused_k);
  const at::Tensor host_used = used_k ? used_k->cpu() : at::Tensor();
  const int* cq = host_q.data_ptr<int>();
  const int* ck = host_k.data_ptr<int>();
  const int* used = used_k ? host_used.data_ptr<int>() : nullptr;
  std::vector<Sequence> out(s.batch);
  for (int64_t b = 0; b < s.batch; ++b) {
    TORCH_CHECK(cq[b] >= 0 && cq[b] <= cq[b + 1] && cq[b + 1] <= s.total_q, "cu_seq_q must rise from 0 or more to ",
                "at most the ", s.total_q, " query tokens; offsets ", b, " and ", b + 1, " are ", cq[b], ", ",
                cq[b + 1]);
    TORCH_CHECK(ck[b] >= 0 && ck[b] <= ck[b + 1] && ck[b + 1] <= s.total_k, "cu_seq_k must rise from 0 or more to ",
                "at most the ", s.total_k, " key tokens; offsets ", b, " and ", b + 1, " are ", ck[b], ", ", ck[b + 1]);
    const int64_t len_k = used ? used[b] : ck[b + 1] - ck[b];
    TORCH_CHECK(len_k >= 0 && len_k <= ck[b + 1] - ck[b], "seqused_k[", b, "] = ", len_k, " must lie in [0, ",
                ck[b + 1] - ck[b], "], sequence ", b, "'s keys");
    TORCH_CHECK(cq[b + 1] - cq[b] <= s.max_q, "max_q (", s.max_q, ") is below sequence ", b, "'s ",
                cq[b + 1] - cq[b], " query tokens");
    TORCH_CHECK(len_k <= s.max_k, "max_k (", s.max_k, ") is below sequence ", b, "'s ", len_k, " keys");
    out[b] = {cq[b], cq[b + 1] - cq[b], ck[b], len_k};
  }
  return out;
}

// The backward's extra tensors of a packed call: grad_out and out as q with
// v's head dim, lse (Hq, total_q) float32 as varlen_fwd returns it.
inline void check_varlen_bwd_extra(const VarlenShape& s, const at::Tensor& grad_out, const at::Tensor& out,
                                   const at::Tensor& lse, const at::Tensor& q) {
  const std::array<int64_t, 3> want{s.total_q, s.heads_q, s.head_dim_v};
  for (auto [t, name] : {std::pair{&grad_out, "grad_out"}, {&out, "out"}}) {
    check_same(*t, name, q);
    TORCH_CHECK(t->sizes() == at::IntArrayRef(want), name, " shape ", t->sizes(),
                " must be (total_q, q heads, v head_dim) = ", at::IntArrayRef(want));
    TORCH_CHECK(t->stride(-1) == 1 || t->size(-1) <= 1, name, " must be contiguous in its last dim, got strides ",
                t->strides());
  }
  TORCH_CHECK(lse.defined() && lse.scalar_type() == at::kFloat && lse.device() == q.device() && lse.dim() == 2 &&
                  lse.size(0) == s.heads_q && lse.size(1) == s.total_q,
              "lse must be a float32 tensor of shape (", s.heads_q, ", ", s.total_q, ") on q's device");
  TORCH_CHECK(lse.is_contiguous(), "lse must be contiguous, got strides ", lse.strides());
}

}  // namespace tfb
