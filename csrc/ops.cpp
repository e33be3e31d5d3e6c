// The op schemas, declared once. Backends register their kernels beside their
// code (cpu/, cuda/); fake kernels and autograd live in torch_flash_backend/ops.py.
//
// Every tensor output is allocated in (B, L, H, E) memory order and returned as
// its (B, H, L, E) view, the layout FlashAttention-style kernels write fastest
// and the one Hugging Face models transpose back into without a copy. lse is a
// contiguous (B, H, L) float32 tensor. The fake kernels return the same strides.
#include <string>
#include <vector>

#include <torch/library.h>

#ifdef TFB_WITH_CUDA
#include "api.h"
#endif

namespace {

std::vector<std::string> built_kernels() {
  std::vector<std::string> names;
#ifdef TFB_WITH_CUDA
  const std::pair<tfb::DType, const char*> dtypes[] = {
      {tfb::DType::kFloat16, "fp16"}, {tfb::DType::kBFloat16, "bf16"}};
  for (const auto& [dtype, dtype_name] : dtypes) {
    for (int head_dim : {32, 64, 96, 128, 192, 256}) {
      const std::string suffix = std::string("_") + dtype_name + "_hdim" + std::to_string(head_dim);
      if (tfb::sm80::has_fwd(dtype, head_dim)) names.push_back("sm80_fwd" + suffix);
      if (tfb::sm80::has_bwd(dtype, head_dim)) names.push_back("sm80_bwd" + suffix);
      if (tfb::sm90::has_fwd(dtype, head_dim)) names.push_back("sm90_fwd" + suffix);
    }
  }
#endif
  return names;
}

}  // namespace


TORCH_LIBRARY(torch_flash_backend, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float? scale=None, bool is_causal=False)"
      " -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,"
      " float? scale=None, bool is_causal=False) -> (Tensor dq, Tensor dk, Tensor dv)");
  // An SDPA call inside enable(): served by fwd or passed to PyTorch's SDPA, as
  // torch_flash_backend/_enable.py decides (its Python kernel); csrc/routing.cpp
  // sends aten::scaled_dot_product_attention here.
  m.def(
      "route_sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0,"
      " bool is_causal=False, float? scale=None, bool enable_gqa=False, bool strict=False) -> Tensor");
  // Names of the compiled CUDA kernel instantiations, e.g. "sm80_fwd_bf16_hdim128".
  m.def("built_kernels() -> str[]", &built_kernels);
}
