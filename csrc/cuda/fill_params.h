// Tensors -> the kernels' params struct (src/params.h).
#pragma once

#include <ATen/core/Tensor.h>

#include "checks.h"
#include "params.h"

namespace tfb {

void fill_fwd(AttnFwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& lse, const AttnShape& s, double scale, int num_sms);

// The call's mask mode: `band` (checks.h mask_args), or the mask check_mask()
// returned (a (B, Hq, L, S) view, boolean or additive) when defined; after
// fill_fwd (an additive mask reads the scale).
void fill_mask(AttnFwdParams& p, const at::Tensor& mask, const MaskArgs& band);

// fill_fwd plus the gradients; p.deterministic follows
// torch.use_deterministic_algorithms (warn_only: the default order, with a warning).
void fill_bwd(AttnBwdParams& p, const at::Tensor& grad_out, const at::Tensor& dq, const at::Tensor& dk,
              const at::Tensor& dv);

}  // namespace tfb
