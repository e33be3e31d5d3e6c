// The switch behind enable(): aten::scaled_dot_product_attention's kernels at
// the autograd and backend keys of CPU and CUDA, registered once when the
// library loads and never changed afterwards. Registering and removing a
// kernel while other threads dispatch the same op is a race in the
// dispatcher (a thread can call a kernel that is being freed), so enable()
// only moves a thread-local stack, and threads outside it go straight to
// PyTorch's own (CompositeImplicitAutograd) kernel.
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/scaled_dot_product_attention_native.h>
#include <torch/library.h>

namespace tfb {
namespace {

// One entry per enable() this thread is inside: its strictness.
thread_local std::vector<bool> routing;

void routing_push(bool strict) { routing.push_back(strict); }

void routing_pop() {
  TORCH_CHECK(!routing.empty(), "torch_flash_backend: routing_pop without routing_push in this thread");
  routing.pop_back();
}

at::Tensor sdpa(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                std::optional<double> scale, bool enable_gqa) {
  if (routing.empty()) {
    return at::native::scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                     enable_gqa);
  }
  // The decision (torch_flash_backend/_enable.py) is a Python kernel of this op.
  static const auto route = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("torch_flash_backend::route_sdpa", "")
                                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const std::optional<at::Tensor>&, double, bool,
                                                  std::optional<double>, bool, bool)>();
  return route.call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, routing.back());
}

}  // namespace
}  // namespace tfb

TORCH_LIBRARY_FRAGMENT(torch_flash_backend, m) {
  m.def("routing_push(bool strict) -> ()", &tfb::routing_push);
  m.def("routing_pop() -> ()", &tfb::routing_pop);
}

// Autograd keys see every call outside torch.inference_mode(); the backend keys
// see the calls made inside it, which skip autograd.
TORCH_LIBRARY_IMPL(aten, AutogradCPU, m) { m.impl("scaled_dot_product_attention", &tfb::sdpa); }
TORCH_LIBRARY_IMPL(aten, AutogradCUDA, m) { m.impl("scaled_dot_product_attention", &tfb::sdpa); }
TORCH_LIBRARY_IMPL(aten, CPU, m) { m.impl("scaled_dot_product_attention", &tfb::sdpa); }
TORCH_LIBRARY_IMPL(aten, CUDA, m) { m.impl("scaled_dot_product_attention", &tfb::sdpa); }
