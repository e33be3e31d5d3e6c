#include "fill_params.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include "common/constants.h"

namespace tfb {
namespace {

// scale * log2(e), as the kernels take it (AttnFwdParams::scale_log2). They
// mask scores to -inf before scaling them, so a zero (or denormal) product
// would make -inf * 0 = NaN; at FLT_MIN every finite score scales to about 0,
// so a zero scale still gives uniform attention.
float scale_log2_of(float scale) {
  const float x = scale * kLog2eFloat;
  return std::fabs(x) < FLT_MIN ? std::copysign(FLT_MIN, x) : x;
}

// As PyTorch's flash backward: torch.use_deterministic_algorithms(True) sums
// dQ in a fixed order; with warn_only=True the default (atomic) order runs
// and says so once.
bool deterministic_bwd() {
  auto& ctx = at::globalContext();
  if (!ctx.deterministicAlgorithms()) return false;
  if (ctx.deterministicAlgorithmsWarnOnly()) {
    TORCH_WARN_ONCE(
        "torch_flash_backend's attention backward defaults to a non-deterministic algorithm (dQ is summed with "
        "atomics). To explicitly enable determinism call torch.use_deterministic_algorithms(True, warn_only=False).");
    return false;
  }
  return true;
}

}  // namespace

void fill_fwd(AttnFwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& lse, const AttnShape& s, double scale, int num_sms) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(2);
  p.batch = static_cast<int>(s.batch);
  p.heads_q = static_cast<int>(s.heads_q);
  p.heads_kv = static_cast<int>(s.heads_kv);
  p.len_q = static_cast<int>(s.len_q);
  p.len_k = static_cast<int>(s.len_k);
  // The tensors' head dims; head_dim becomes the kernel's once the family is
  // chosen (families.h forward_kernels / backward_kernels).
  p.qk_dim = static_cast<int>(s.head_dim);
  p.v_dim = static_cast<int>(s.head_dim_v);
  p.head_dim = std::max(p.qk_dim, p.v_dim);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = scale_log2_of(p.scale);
  p.num_sms = num_sms;
}

void fill_mask(AttnFwdParams& p, const at::Tensor& mask, const MaskArgs& band) {
  p.mask = band;
  if (!mask.defined()) return;
  p.mask.mode = mask.scalar_type() == at::kBool ? MaskMode::kBool : MaskMode::kAdditive;
  switch (mask.scalar_type()) {
    case at::kBool: p.mask.values_type = MaskValues::kBool; break;
    case at::kHalf: p.mask.values_type = MaskValues::kFloat16; break;
    case at::kBFloat16: p.mask.values_type = MaskValues::kBFloat16; break;
    case at::kFloat: p.mask.values_type = MaskValues::kFloat32; break;
    default: TORCH_CHECK(false, "attn_mask of dtype ", mask.scalar_type(), " has no kernel reading it");
  }
  p.mask.values = static_cast<const uint8_t*>(mask.data_ptr());
  const int64_t bytes = mask.element_size();
  p.mask.values_batch_stride = mask.stride(0) * bytes, p.mask.values_head_stride = mask.stride(1) * bytes;
  p.mask.values_row_stride = mask.stride(2) * bytes, p.mask.values_col_stride = mask.stride(3) * bytes;
  // The inverse of the scale the kernels apply (scale_log2 may be held off 0).
  p.mask.values_scale = static_cast<float>(kLog2e / p.scale_log2);
}

void fill_bwd(AttnBwdParams& p, const at::Tensor& grad_out, const at::Tensor& dq, const at::Tensor& dk,
              const at::Tensor& dv) {
  p.deterministic = deterministic_bwd();
  p.dout = grad_out.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.do_batch_stride = grad_out.stride(0), p.do_head_stride = grad_out.stride(1), p.do_row_stride = grad_out.stride(2);
  p.dq_batch_stride = dq.stride(0), p.dq_head_stride = dq.stride(1), p.dq_row_stride = dq.stride(2);
  p.dk_batch_stride = dk.stride(0), p.dk_head_stride = dk.stride(1), p.dk_row_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0), p.dv_head_stride = dv.stride(1), p.dv_row_stride = dv.stride(2);
}

}  // namespace tfb
