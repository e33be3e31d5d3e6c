// CUDA impls of the ops: check the arguments, fill the params struct
// (fill_params.h), launch the kernel of the op's `family` argument
// (families.h checks it can) on the current stream.
#include <algorithm>
#include <climits>
#include <cmath>
#include <mutex>
#include <initializer_list>
#include <limits>

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "api.h"
#include "checks.h"
#include "common/dropout_mask.h"
#include "common/packed_rows.h"
#include "device.h"
#include "families.h"
#include "fill_params.h"
#include "kernel_list.h"

namespace tfb {
namespace {

DType to_dtype(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "CUDA kernels take float16 or bfloat16 inputs, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? DType::kFloat16 : DType::kBFloat16;
}

// The kernels move vectors: every row must start on the boundary the registry
// names (align_bytes; the largest of the families', before one is chosen).
void check_vector_aligned(const at::Tensor& t, const char* name) {
  constexpr int64_t kBytes = TFB_ALIGN_BYTES_MAX;
  const int64_t vec = kBytes / t.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % kBytes == 0, name, " data pointer must be ", kBytes,
              "-byte aligned");
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(t.size(d) <= 1 || t.stride(d) % vec == 0, name, " stride(", d, ") = ", t.stride(d),
                " must be a multiple of ", vec, " elements (", kBytes, " bytes)");
  }
}

const DeviceInfo& check_cuda_device(const at::Tensor& q) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  const DeviceInfo& info = device_info(q.get_device());
  TORCH_CHECK(info.major >= 8, "torch_flash_backend CUDA kernels need compute capability >= 8.0, device ",
              q.device(), " has ", info.major, ".", info.minor);
  return info;
}

// Allocates the scratch `kernels` asks for into p.workspace; the tensor keeps it alive.
template <class Params>
at::Tensor attach_workspace(const PassKernels<Params>& kernels, Params& p, const at::Tensor& q) {
  const size_t bytes = kernels.workspace_bytes(p);
  if (bytes == 0) return {};
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  return workspace;
}

// Runs the chosen kernels on the current stream, with the scratch they ask for.
template <class Params>
void launch(const PassKernels<Params>& chosen, Params& p, DType dtype, const at::Tensor& q) {
  const at::Tensor workspace = attach_workspace(chosen, p, q);
  const cudaError_t err = chosen.run(p, dtype, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "torch_flash_backend ", chosen.name(dtype, p.head_dim),
              " launch failed: ", cudaGetErrorString(err));
}

// Dropout's threshold and factor for p (params.h DropoutArgs).
DropoutArgs dropout_of(double dropout_p) {
  TORCH_CHECK(dropout_p > 0.0 && dropout_p < 1.0, "dropout_p must be in (0, 1), got ", dropout_p);
  DropoutArgs a;
  const double draws = DropoutArgs::kDraws;  // p in steps of 1 / draws, at least one and at most draws - 1
  a.threshold = uint32_t(std::min(draws - 1.0, std::max(1.0, std::nearbyint(dropout_p * draws))));
  a.keep_scale = float(1.0 / (1.0 - dropout_p));
  return a;
}

// A forward's draws: 4 * batch * heads_q of PyTorch's CUDA generator's offsets
// (common/dropout.h), as values or, while a CUDA graph is captured, as the
// pointers its replays fill; the kernel records the pair in rng_state.
DropoutArgs forward_dropout(double dropout_p, const AttnShape& s, const at::Tensor& rng_state) {
  DropoutArgs a = dropout_of(dropout_p);
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt,
                                                                  at::cuda::detail::getDefaultCUDAGenerator());
  at::PhiloxCudaState philox;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(uint64_t(4) * uint64_t(s.batch) * uint64_t(s.heads_q));
  }
  if (philox.captured_) {
    a.seed_ptr = philox.seed_.ptr;
    a.offset_ptr = philox.offset_.ptr;
    a.offset_extra = philox.offset_intragraph_;
  } else {
    a.seed = philox.seed_.val;
    a.offset = philox.offset_.val;
  }
  a.rng_state = rng_state.data_ptr<int64_t>();
  return a;
}

// The backward's: the pair its forward recorded.
DropoutArgs recorded_dropout(double dropout_p, const at::Tensor& rng_state, const at::Tensor& q) {
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.numel() == 2 && rng_state.is_contiguous() &&
                  rng_state.device() == q.device(),
              "rng_state must be the forward's: 2 int64 values on ", q.device(), ", got ", rng_state.scalar_type(),
              " of shape ", rng_state.sizes(), " on ", rng_state.device());
  DropoutArgs a = dropout_of(dropout_p);
  a.seed_ptr = rng_state.data_ptr<int64_t>();
  a.offset_ptr = a.seed_ptr + 1;
  return a;
}

std::tuple<at::Tensor, at::Tensor> fwd_run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           std::optional<double> scale, bool is_causal,
                                           std::optional<c10::string_view> family,
                                           const std::optional<at::Tensor>& attn_mask, bool bottom_right,
                                           int64_t window_left, int64_t window_right, double dropout_p,
                                           const at::Tensor& rng_state) {
  const AttnShape s = check_qkv(q, k, v);
  const at::Tensor mask = check_mask(attn_mask, q, s, softmax_scale(scale, s.head_dim));
  const MaskArgs band = mask_args(mask.defined(), is_causal, bottom_right, window_left, window_right);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out, lse;
  std::tie(out, lse) = fwd_outputs(q, s);
  if (is_empty_problem(s)) return {out, lse};
  const DeviceInfo& info = check_cuda_device(q);
  const DType dtype = to_dtype(q);
  check_vector_aligned(q, "q");
  check_vector_aligned(k, "k");
  check_vector_aligned(v, "v");
  AttnFwdParams p{};
  fill_fwd(p, q, k, v, out, lse, s, softmax_scale(scale, s.head_dim), info.num_sms);
  fill_mask(p, mask, band);
  if (dropout_p != 0.0) p.dropout = forward_dropout(dropout_p, s, rng_state);
  const FwdKernels& chosen = forward_kernels(family, info, dtype, p);
  launch(chosen, p, dtype, q);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            std::optional<double> scale, bool is_causal,
                                            std::optional<c10::string_view> family,
                                            std::optional<c10::string_view> /*backward_family: autograd's*/,
                                            const std::optional<at::Tensor>& attn_mask, bool bottom_right,
                                            int64_t window_left, int64_t window_right) {
  return fwd_run(q, k, v, scale, is_causal, family, attn_mask, bottom_right, window_left, window_right, 0.0, {});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dropout_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p, std::optional<double> scale,
    bool is_causal, std::optional<c10::string_view> family,
    std::optional<c10::string_view> /*backward_family: autograd's*/, const std::optional<at::Tensor>& attn_mask,
    bool bottom_right, int64_t window_left, int64_t window_right) {
  dropout_of(dropout_p);  // checks p before anything runs
  // Zeros until the kernel records its pair (an empty problem launches none).
  const at::Tensor rng_state = at::zeros({2}, q.options().dtype(at::kLong));
  auto [out, lse] = fwd_run(q, k, v, scale, is_causal, family, attn_mask, bottom_right, window_left, window_right,
                            dropout_p, rng_state);
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_run(const at::Tensor& grad_out, const at::Tensor& q,
                                                       const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& out, const at::Tensor& lse,
                                                       std::optional<double> scale, bool is_causal,
                                                       std::optional<c10::string_view> family,
                                                       const std::optional<at::Tensor>& attn_mask, bool bottom_right,
                                                       int64_t window_left, int64_t window_right, double dropout_p,
                                                       const at::Tensor& rng_state) {
  const AttnShape s = check_qkv(q, k, v);
  const DropoutArgs dropout = dropout_p != 0.0 ? recorded_dropout(dropout_p, rng_state, q) : DropoutArgs{};
  check_bwd_extra(grad_out, out, lse, q, s);
  const at::Tensor mask = check_mask(attn_mask, q, s, softmax_scale(scale, s.head_dim));
  const MaskArgs band = mask_args(mask.defined(), is_causal, bottom_right, window_left, window_right);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor dq, dk, dv;
  std::tie(dq, dk, dv) = bwd_outputs(q, k, v, s);
  if (is_empty_problem(s)) return {dq, dk, dv};
  const DeviceInfo& info = check_cuda_device(q);
  const DType dtype = to_dtype(q);
  check_vector_aligned(q, "q");
  check_vector_aligned(k, "k");
  check_vector_aligned(v, "v");
  check_vector_aligned(out, "out");
  check_vector_aligned(grad_out, "grad_out");
  AttnBwdParams p{};
  fill_fwd(p, q, k, v, out, lse, s, softmax_scale(scale, s.head_dim), info.num_sms);
  fill_mask(p, mask, band);
  fill_bwd(p, grad_out, dq, dk, dv);
  p.dropout = dropout;
  const BwdKernels& chosen = backward_kernels(family, info, dtype, p);
  launch(chosen, p, dtype, q);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& lse,
                                                        std::optional<double> scale, bool is_causal,
                                                        std::optional<c10::string_view> family,
                                                        const std::optional<at::Tensor>& attn_mask,
                                                        bool bottom_right, int64_t window_left,
                                                        int64_t window_right) {
  return bwd_run(grad_out, q, k, v, out, lse, scale, is_causal, family, attn_mask, bottom_right, window_left,
                 window_right, 0.0, {});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dropout_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& rng_state, double dropout_p, std::optional<double> scale,
    bool is_causal, std::optional<c10::string_view> family, const std::optional<at::Tensor>& attn_mask,
    bool bottom_right, int64_t window_left, int64_t window_right) {
  return bwd_run(grad_out, q, k, v, out, lse, scale, is_causal, family, attn_mask, bottom_right, window_left,
                 window_right, dropout_p, rng_state);
}

// The pairs a dropout_fwd call kept (common/dropout_mask.h), as a bool tensor.
at::Tensor dropout_mask_cuda(const at::Tensor& rng_state, double dropout_p, int64_t batch, int64_t heads,
                             int64_t len_q, int64_t len_k) {
  TORCH_CHECK(rng_state.is_cuda(), "rng_state must be a CUDA tensor");
  TORCH_CHECK(batch >= 0 && heads >= 0 && len_q >= 0 && len_k >= 0 && batch <= INT_MAX && heads <= INT_MAX &&
                  len_q <= INT_MAX && len_k <= INT_MAX,
              "batch, heads, len_q and len_k must be in [0, 2^31), got ", batch, ", ", heads, ", ", len_q, ", ",
              len_k);
  c10::cuda::CUDAGuard guard(rng_state.device());
  const DropoutArgs a = recorded_dropout(dropout_p, rng_state, rng_state);
  at::Tensor kept = at::empty({batch, heads, len_q, len_k}, rng_state.options().dtype(at::kBool));
  const cudaError_t err = dropout_keep_mask(a, reinterpret_cast<uint8_t*>(kept.data_ptr<bool>()), int(batch),
                                            int(heads), int(len_q), int(len_k),
                                            c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "torch_flash_backend dropout_mask launch failed: ", cudaGetErrorString(err));
  return kept;
}

// A packed batch: the dense path's params over (1, H, total, E) views of the
// packed tensors, then the per-batch lengths and offsets (params.h SeqLens),
// which the family reads through the params' accessors. The offsets' values
// stay on the device: the kernels clamp what they read (a wrong offset reads
// and writes inside the tensors only), and the rows no kernel writes (before
// the first sequence, after the last, keys past seqused_k) are cleared there
// too (common/packed_rows.h): no copy to the host, no sync.
at::Tensor as_rows(const at::Tensor& t) { return t.unsqueeze(0).transpose(1, 2); }  // (1, H, total, E)

bool nothing_to_compute(const VarlenShape& s) {
  return s.batch == 0 || s.max_q == 0 || s.max_k == 0 || s.heads_q == 0 || s.head_dim == 0;
}

void fill_varlen(AttnFwdParams& p, const VarlenShape& s, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seq_q,
                 const at::Tensor& cu_seq_k, const std::optional<at::Tensor>& seqused_k, std::optional<double> scale,
                 const MaskArgs& band, const DeviceInfo& info) {
  check_vector_aligned(as_rows(q), "q");
  check_vector_aligned(as_rows(k), "k");
  check_vector_aligned(as_rows(v), "v");
  TORCH_CHECK(s.total_q < INT32_MAX && s.total_k < INT32_MAX, "packed batches hold fewer than 2^31 tokens");
  fill_fwd(p, as_rows(q), as_rows(k), as_rows(v), as_rows(out), lse.unsqueeze(0),
           {1, s.heads_q, s.heads_kv, s.total_q, s.total_k, s.head_dim, s.head_dim_v}, softmax_scale(scale, s.head_dim),
           info.num_sms);
  fill_mask(p, at::Tensor(), band);
  p.batch = static_cast<int>(s.batch);
  p.len_q = static_cast<int>(s.max_q);
  p.len_k = static_cast<int>(s.max_k);
  p.seqlens.cu_q = cu_seq_q.data_ptr<int>();
  p.seqlens.cu_k = cu_seq_k.data_ptr<int>();
  const at::Tensor* used_k = present(seqused_k);
  p.seqlens.used_k = used_k ? used_k->data_ptr<int>() : nullptr;
  p.seqlens.total_q = s.total_q;
  p.seqlens.total_k = s.total_k;
}

// Clears the rows of `rows` (and lse's columns) that no kernel writes.
void clear_unwritten(const AttnFwdParams& p, bool keys, std::initializer_list<at::Tensor> rows,
                     const at::Tensor& lse = {}) {
  PackedRows clear;
  clear.seqlens = p.seqlens;
  clear.keys = keys;
  clear.batch = p.batch;
  clear.max_len = keys ? p.len_k : p.len_q;
  int i = 0;
  for (const at::Tensor& t : rows) {
    clear.rows[i++] = t.data_ptr();
    clear.row_bytes = t.stride(0) * t.element_size();
  }
  if (lse.defined()) {
    clear.lse = lse.data_ptr<float>();
    clear.heads = static_cast<int>(lse.size(0));
  }
  const cudaError_t err = clear_unwritten_rows(clear, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "torch_flash_backend: clearing a packed batch's unwritten rows failed: ",
              cudaGetErrorString(err));
}

// Rows no sequence covers, and sequences without keys, give 0 (lse -inf).
std::tuple<at::Tensor, at::Tensor> varlen_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& cu_seq_q, const at::Tensor& cu_seq_k,
                                                   int64_t max_q, int64_t max_k, std::optional<double> scale,
                                                   bool is_causal, std::optional<c10::string_view> family,
                                                   std::optional<c10::string_view> /*backward_family: autograd's*/,
                                                   int64_t window_left, int64_t window_right,
                                                   const std::optional<at::Tensor>& seqused_k) {
  const VarlenShape s = check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k);
  const MaskArgs band = mask_args(false, is_causal, true, window_left, window_right);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({s.total_q, s.heads_q, s.head_dim_v}, q.options());
  at::Tensor lse = at::empty({s.heads_q, s.total_q}, q.options().dtype(at::kFloat));
  if (nothing_to_compute(s)) return {out.zero_(), lse.fill_(-std::numeric_limits<float>::infinity())};
  const DeviceInfo& info = check_cuda_device(q);
  const DType dtype = to_dtype(q);
  AttnFwdParams p{};
  fill_varlen(p, s, q, k, v, out, lse, cu_seq_q, cu_seq_k, seqused_k, scale, band, info);
  const FwdKernels& chosen = forward_kernels(family, info, dtype, p);
  launch(chosen, p, dtype, q);
  clear_unwritten(p, false, {out}, lse);
  return {out, lse};
}

// dq rows no sequence covers, and keys no sequence reads (outside the
// sequences, or past seqused_k), get 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seq_q, const at::Tensor& cu_seq_k, int64_t max_q, int64_t max_k,
    std::optional<double> scale, bool is_causal, std::optional<c10::string_view> family, int64_t window_left,
    int64_t window_right, const std::optional<at::Tensor>& seqused_k) {
  const VarlenShape s = check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k);
  check_varlen_bwd_extra(s, grad_out, out, lse, q);
  const MaskArgs band = mask_args(false, is_causal, true, window_left, window_right);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
             dv = at::empty(v.sizes(), v.options());
  if (nothing_to_compute(s)) return {dq.zero_(), dk.zero_(), dv.zero_()};
  const DeviceInfo& info = check_cuda_device(q);
  const DType dtype = to_dtype(q);
  check_vector_aligned(as_rows(out), "out");
  check_vector_aligned(as_rows(grad_out), "grad_out");
  AttnBwdParams p{};
  fill_varlen(p, s, q, k, v, out, lse, cu_seq_q, cu_seq_k, seqused_k, scale, band, info);
  fill_bwd(p, as_rows(grad_out), as_rows(dq), as_rows(dk), as_rows(dv));
  const BwdKernels& chosen = backward_kernels(family, info, dtype, p);
  launch(chosen, p, dtype, q);
  clear_unwritten(p, false, {dq});
  clear_unwritten(p, true, {dk, dv});
  return {dq, dk, dv};
}

// FP8 (e4m3) inputs: the sm90 family's FP8 forward alone runs them, O in
// bfloat16. A descale is a float32 (batch, kv heads) tensor, read in place
// with its strides; none reads as 1.
Descale check_descale(const std::optional<at::Tensor>& t, const char* name, const at::Tensor& q, int64_t batch,
                      int64_t heads_kv) {
  const at::Tensor* d = present(t);
  if (!d) return {};
  TORCH_CHECK(d->scalar_type() == at::kFloat, name, " must be float32, got ", d->scalar_type());
  TORCH_CHECK(d->device() == q.device(), name, " is on ", d->device(), " but q is on ", q.device());
  TORCH_CHECK(d->layout() == at::kStrided && d->dim() == 2 && d->size(0) == batch && d->size(1) == heads_kv, name,
              " must have shape (batch, kv heads) = (", batch, ", ", heads_kv, "), got ", d->sizes());
  return {d->data_ptr<float>(), d->stride(0), d->stride(1)};
}

void check_fp8_inputs(const at::Tensor& q, const DeviceInfo& info, int64_t head_dim, int64_t head_dim_v) {
  TORCH_CHECK(q.scalar_type() == at::kFloat8_e4m3fn, "FP8 attention takes float8_e4m3fn q, k, v, got ",
              q.scalar_type());
  TORCH_CHECK(head_dim_v == head_dim, "FP8 attention takes v of q's head dim (", head_dim, "), got ", head_dim_v);
  TORCH_CHECK(info.major == 9 && info.minor == 0, "FP8 attention runs on compute capability 9.0 (Hopper); device ",
              q.device(), " has ", info.major, ".", info.minor);
  TORCH_CHECK(sm90::has_fwd(DType::kFloat8E4M3, static_cast<int>(head_dim)),
              "FP8 attention has no kernel for head_dim ", head_dim, " in this build (registry fp8_head_dims)");
}

// Runs the sm90 FP8 forward on filled params (their element size set here).
void launch_fp8(AttnFwdParams& p, const at::Tensor& q, Descales descales) {
  p.element_bytes = 1;
  p.descales = descales;
  TORCH_CHECK(sm90::can_run_fwd(p), "FP8 attention needs q, k, v and out 16-byte aligned with strides (but the "
              "last) of nonzero multiples of 16 bytes");
  at::Tensor workspace;
  if (const size_t bytes = sm90::fwd_workspace_bytes(p)) {
    workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
  }
  const cudaError_t err = sm90::run_fwd(p, DType::kFloat8E4M3, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "torch_flash_backend sm90_fwd_fp8_hdim", p.head_dim,
              " launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> fp8_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const std::optional<at::Tensor>& q_descale,
                                                const std::optional<at::Tensor>& k_descale,
                                                const std::optional<at::Tensor>& v_descale,
                                                std::optional<double> scale, bool is_causal, bool bottom_right) {
  const AttnShape s = check_qkv(q, k, v);
  const Descales descales{check_descale(q_descale, "q_descale", q, s.batch, s.heads_kv),
                          check_descale(k_descale, "k_descale", q, s.batch, s.heads_kv),
                          check_descale(v_descale, "v_descale", q, s.batch, s.heads_kv)};
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = empty_blhe(s.batch, s.heads_q, s.len_q, s.head_dim, q.options().dtype(at::kBFloat16));
  at::Tensor lse = at::empty({s.batch, s.heads_q, s.len_q}, q.options().dtype(at::kFloat));
  if (is_empty_problem(s)) return {out.zero_(), lse.fill_(-std::numeric_limits<float>::infinity())};
  const DeviceInfo& info = check_cuda_device(q);
  check_fp8_inputs(q, info, s.head_dim, s.head_dim_v);
  check_vector_aligned(q, "q");
  check_vector_aligned(k, "k");
  check_vector_aligned(v, "v");
  AttnFwdParams p{};
  fill_fwd(p, q, k, v, out, lse, s, softmax_scale(scale, s.head_dim), info.num_sms);
  fill_mask(p, at::Tensor(), mask_args(false, is_causal, bottom_right, -1, -1));
  launch_fp8(p, q, descales);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> fp8_varlen_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seq_q,
    const at::Tensor& cu_seq_k, int64_t max_q, int64_t max_k, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale,
    std::optional<double> scale, bool is_causal, const std::optional<at::Tensor>& seqused_k) {
  const VarlenShape s = check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k);
  const Descales descales{check_descale(q_descale, "q_descale", q, s.batch, s.heads_kv),
                          check_descale(k_descale, "k_descale", q, s.batch, s.heads_kv),
                          check_descale(v_descale, "v_descale", q, s.batch, s.heads_kv)};
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({s.total_q, s.heads_q, s.head_dim}, q.options().dtype(at::kBFloat16));
  at::Tensor lse = at::empty({s.heads_q, s.total_q}, q.options().dtype(at::kFloat));
  if (nothing_to_compute(s)) return {out.zero_(), lse.fill_(-std::numeric_limits<float>::infinity())};
  const DeviceInfo& info = check_cuda_device(q);
  check_fp8_inputs(q, info, s.head_dim, s.head_dim_v);
  AttnFwdParams p{};
  fill_varlen(p, s, q, k, v, out, lse, cu_seq_q, cu_seq_k, seqused_k, scale,
              mask_args(false, is_causal, true, -1, -1), info);
  launch_fp8(p, q, descales);
  clear_unwritten(p, false, {out}, lse);
  return {out, lse};
}

}  // namespace
}  // namespace tfb

TORCH_LIBRARY_IMPL(torch_flash_backend, CUDA, m) {
  m.impl("fwd", &tfb::fwd_cuda);
  m.impl("bwd", &tfb::bwd_cuda);
  m.impl("dropout_fwd", &tfb::dropout_fwd_cuda);
  m.impl("dropout_bwd", &tfb::dropout_bwd_cuda);
  m.impl("dropout_mask", &tfb::dropout_mask_cuda);
  m.impl("varlen_fwd", &tfb::varlen_fwd_cuda);
  m.impl("varlen_bwd", &tfb::varlen_bwd_cuda);
  m.impl("fp8_fwd", &tfb::fp8_fwd_cuda);
  m.impl("fp8_varlen_fwd", &tfb::fp8_varlen_fwd_cuda);
}
