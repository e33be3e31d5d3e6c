// The switch behind enable(): aten::scaled_dot_product_attention's kernels at
// the autograd and backend keys of CPU and CUDA, registered once when the
// library loads and never changed afterwards. Registering and removing a
// kernel while other threads dispatch the same op is a race in the
// dispatcher (a thread can call a kernel that is being freed), so enable()
// only moves thread-local state, and threads outside it go straight to
// PyTorch's own (CompositeImplicitAutograd) kernel.
//
// Inside enable(), the decision is the router's (torch_flash_backend/_router.py,
// reached through the route_sdpa op). The router keeps its decisions here, in
// the one decision cache (routing_lookup / routing_remember): a plain eager
// call whose metadata was decided before (attn_mask's included) takes its
// decision from this thread's cache without Python: served calls go straight
// to the fwd op, fallbacks to PyTorch's SDPA.
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/scaled_dot_product_attention_native.h>
#include <torch/library.h>

#include "common/mask_values.h"
#include "kernel_list.h"

namespace tfb {
namespace {

// ------------------------------------------------------- the routing state

// enable() keeps its state where torch.compile sees it: Dynamo's guards read
// PyTorch's per-thread autocast state of every device type, so a compiled
// function recompiles when it crosses enable()'s boundary, while no other
// call pays anything. enable() (torch_flash_backend/_enable.py) sets autocast
// for IPU, a device type this library never runs on and no CPU or CUDA tensor
// carries the key of (so no op changes), and says in its dtype how calls are
// routed. Nesting is Python's: each enable() restores the state it found.
constexpr c10::DeviceType kMarkDevice = c10::DeviceType::IPU;

struct Frame {
  bool strict;
  bool log_each_call;  // the logger wants a line per call: every call asks the router
};

// The innermost enable() of this thread, if any. The dtypes: bfloat16 plain,
// float32 strict, float16 logging, float64 strict and logging.
std::optional<Frame> routing_frame() {
  if (!at::autocast::is_autocast_enabled(kMarkDevice)) return std::nullopt;
  switch (at::autocast::get_autocast_dtype(kMarkDevice)) {
    case at::kBFloat16: return Frame{false, false};
    case at::kFloat: return Frame{true, false};
    case at::kHalf: return Frame{false, true};
    case at::kDouble: return Frame{true, true};
    default: return std::nullopt;  // autocast for IPU, set by someone else
  }
}

// ------------------------------------------------------ the decision cache

// What the router reads of a call (torch_flash_backend/_router.py, decide):
// metadata, not data. The storage offset enters as its remainder modulo the
// largest family's align_bytes (TFB_ALIGN_BYTES_MAX), the alignment rule's only use of it.
struct TensorKey {
  int64_t sizes[4];
  int64_t strides[4];
  int64_t offset_class;
};

// The settings of a call besides its tensors.
enum KeyFlag : int32_t {
  kCausal = 1,
  kGqa = 1 << 1,
  kNeedsGrad = 1 << 2,
  kMasked = 1 << 3,
  kMaskRequiresGrad = 1 << 4,
  kBottomRight = 1 << 5,
  kPinned = 1 << 6,  // the choice for flash_attn (any family that runs the call), not enable()'s
};

struct Key {
  TensorKey t[3];
  TensorKey mask;  // attn_mask's first mask_dim sizes and strides; zeros without one
  double dropout_p;
  int32_t dtype;
  int32_t device_type;
  int32_t device_index;
  int32_t flags;  // KeyFlag
  int32_t mask_dtype;
  int32_t mask_dim;
  int32_t window_left, window_right;

  bool operator==(const Key& other) const { return std::memcmp(this, &other, sizeof(Key)) == 0; }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    uint64_t words[sizeof(Key) / sizeof(uint64_t)];
    std::memcpy(words, &key, sizeof(words));
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (uint64_t w : words) h = (h ^ w) * 0x100000001b3ull;
    return static_cast<size_t>(h ^ (h >> 29));
  }
};
static_assert(sizeof(Key) % sizeof(uint64_t) == 0, "Key hashes as whole words");

struct Entry {
  bool served;
  std::string family, backward_family;
  int64_t decision;  // the router's number for it; the calls served from here count under it (_stats.py)
};

// Settings the router reads besides the call: the probe and switches Python
// changes (a generation it bumps) and the kernel-family setting.
std::atomic<uint64_t> generation{0};
constexpr const char* kFamiliesEnv = "TFB_KERNEL_FAMILIES";
constexpr size_t kMaxEntries = 4096;

struct Cache {
  uint64_t generation = ~0ull;
  std::string families_env;
  std::unordered_map<Key, Entry, KeyHash> entries;
};
thread_local Cache cache;

// Per-decision counts of the calls served from the cache; Python adds its own.
constexpr int64_t kMaxDecisions = 4096;
std::array<std::atomic<int64_t>, kMaxDecisions> counts{};

// No FakeTensor, functional or batched wrapper (tracing): such calls ask the router.
bool unwrapped(const at::Tensor& t) {
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                            c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Batched});
  return !t.key_set().has_any(wrapped);
}

// A dense 4-D CPU or CUDA tensor of autograd's and the backends' keys only.
bool plain(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && !t.is_nested() && t.dim() == 4 && unwrapped(t) &&
         (t.is_cuda() || t.is_cpu());
}

// attn_mask's part of the key: a dense tensor of at most 4 dims on q's device
// (the router reads its dtype, sizes, device and whether it requires grad;
// anything else is decided afresh).
bool plain_mask(const at::Tensor& m, const at::Tensor& q) {
  return m.defined() && m.layout() == at::kStrided && !m.is_nested() && m.dim() <= 4 && m.device() == q.device() &&
         unwrapped(m);
}

// The settings decide() reads besides the tensors; an SDPA call's are
// needs_grad as autograd sees it, top-left, no window, enable()'s choice.
struct Settings {
  bool needs_grad;
  bool bottom_right = false;
  int64_t window_left = -1, window_right = -1;
  bool pinned = false;
};

std::optional<Key> key_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                          bool enable_gqa, std::optional<double> scale, const Settings& settings) {
  if (!plain(q) || !plain(k) || !plain(v)) return std::nullopt;
  // The key holds no scale: an additive mask with a scale too small for the
  // kernels (which falls back) is decided afresh.
  if (attn_mask.has_value() && attn_mask->scalar_type() != at::kBool && scale.has_value() &&
      std::abs(*scale) < mask::kAdditiveMinScale)
    return std::nullopt;
  // Inputs on other devices or of other dtypes are decided afresh (they fall back).
  if (k.device() != q.device() || v.device() != q.device() || k.scalar_type() != q.scalar_type() ||
      v.scalar_type() != q.scalar_type())
    return std::nullopt;
  if (attn_mask.has_value() && !plain_mask(*attn_mask, q)) return std::nullopt;
  Key key;
  std::memset(&key, 0, sizeof(key));  // padding takes part in == and the hash
  const at::Tensor* ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    const at::Tensor& t = *ts[i];
    for (int d = 0; d < 4; ++d) {
      key.t[i].sizes[d] = t.size(d);
      key.t[i].strides[d] = t.stride(d);
    }
    const int64_t vec = std::max<int64_t>(1, TFB_ALIGN_BYTES_MAX / static_cast<int64_t>(t.element_size()));
    key.t[i].offset_class = t.storage_offset() % vec;
  }
  key.dropout_p = dropout_p;
  key.dtype = static_cast<int32_t>(q.scalar_type());
  key.device_type = static_cast<int32_t>(q.device().type());
  key.device_index = q.device().index();
  key.flags = (is_causal ? kCausal : 0) | (enable_gqa ? kGqa : 0) | (settings.needs_grad ? kNeedsGrad : 0) |
              (settings.bottom_right ? kBottomRight : 0) | (settings.pinned ? kPinned : 0);
  if (settings.window_left < INT32_MIN || settings.window_left > INT32_MAX || settings.window_right < INT32_MIN ||
      settings.window_right > INT32_MAX)
    return std::nullopt;
  key.window_left = static_cast<int32_t>(settings.window_left);
  key.window_right = static_cast<int32_t>(settings.window_right);
  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    for (int64_t d = 0; d < m.dim(); ++d) {
      key.mask.sizes[d] = m.size(d);
      key.mask.strides[d] = m.stride(d);
    }
    key.mask_dim = static_cast<int32_t>(m.dim());
    key.mask_dtype = static_cast<int32_t>(m.scalar_type());
    key.flags |= kMasked | (m.requires_grad() ? kMaskRequiresGrad : 0);
  }
  return key;
}

// This thread's cache, emptied when the settings it was filled under changed.
Cache& current_cache() {
  const char* env = std::getenv(kFamiliesEnv);
  const char* families = env ? env : "";
  const uint64_t now = generation.load(std::memory_order_acquire);
  if (cache.generation != now || cache.families_env != families) {
    cache.entries.clear();
    cache.generation = now;
    cache.families_env = families;
  }
  return cache;
}

// ------------------------------------------------------------------ the ops

// The router's decision (its number, -1 for none) for a call it decided
// before with these settings; -1 also for a call that is not cached (decided afresh).
int64_t routing_lookup(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                       bool enable_gqa, std::optional<double> scale, bool needs_grad, bool bottom_right,
                       int64_t window_left, int64_t window_right, bool pinned) {
  const std::optional<Key> key = key_of(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, scale,
                                        Settings{needs_grad, bottom_right, window_left, window_right, pinned});
  if (!key.has_value()) return -1;
  const Cache& c = current_cache();
  const auto it = c.entries.find(*key);
  return it == c.entries.end() ? -1 : it->second.decision;
}

// Keeps the router's decision for the call (routing_lookup's arguments).
void routing_remember(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                      bool enable_gqa, std::optional<double> scale, bool needs_grad, bool bottom_right,
                      int64_t window_left, int64_t window_right, bool pinned, bool served,
                      c10::string_view family, c10::string_view backward_family, int64_t decision) {
  const std::optional<Key> key = key_of(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, scale,
                                        Settings{needs_grad, bottom_right, window_left, window_right, pinned});
  if (!key.has_value() || decision < 0 || decision >= kMaxDecisions) return;
  Cache& c = current_cache();
  if (c.entries.size() >= kMaxEntries) c.entries.clear();
  c.entries[*key] = Entry{served, std::string(family), std::string(backward_family), decision};
}

// The router's settings changed (Python's probe): every thread decides afresh.
void routing_invalidate() { generation.fetch_add(1, std::memory_order_acq_rel); }

std::vector<int64_t> routing_counts() {
  std::vector<int64_t> out(kMaxDecisions);
  for (int64_t i = 0; i < kMaxDecisions; ++i) out[i] = counts[i].load(std::memory_order_relaxed);
  return out;
}

void routing_reset_counts() {
  for (auto& c : counts) c.store(0, std::memory_order_relaxed);
}

// ------------------------------------------------------------- the kernel

at::Tensor pytorch_sdpa(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                        std::optional<double> scale, bool enable_gqa) {
  return at::native::scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                  enable_gqa);
}

at::Tensor serve(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale,
                 const Entry& entry, bool needs_grad) {
  static const auto fwd =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torch_flash_backend::fwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    std::optional<double>, bool, std::optional<c10::string_view>,
                                                    std::optional<c10::string_view>,
                                                    const std::optional<at::Tensor>&, bool, int64_t, int64_t)>();
  const std::optional<c10::string_view> family = c10::string_view(entry.family);
  const std::optional<c10::string_view> backward_family =
      entry.backward_family.empty() ? std::nullopt : std::optional<c10::string_view>(entry.backward_family);
  // SDPA's is_causal: top-left; no window.
  auto call = [&] { return std::get<0>(fwd.call(q, k, v, scale, is_causal, family, backward_family, attn_mask, false, -1, -1)); };
  if (needs_grad) return call();
  // Nothing to differentiate: skip the op's autograd formula (a Python kernel).
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call();
}

at::Tensor sdpa(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                std::optional<double> scale, bool enable_gqa) {
  const std::optional<Frame> routing = routing_frame();
  if (!routing.has_value()) {
    return pytorch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
  }
  const Frame frame = *routing;
  std::optional<Key> cache_key;
  if (!frame.log_each_call) {
    const bool needs_grad = at::GradMode::is_enabled() &&
                            (query.requires_grad() || key.requires_grad() || value.requires_grad());
    cache_key = key_of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, scale, Settings{needs_grad});
  }
  if (cache_key.has_value()) {
    Cache& c = current_cache();
    const auto it = c.entries.find(*cache_key);
    if (it != c.entries.end() && (it->second.served || !frame.strict)) {
      const Entry& entry = it->second;
      counts[entry.decision].fetch_add(1, std::memory_order_relaxed);
      if (!entry.served) {
        return pytorch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
      }
      // The fwd op never reaches this switch again, so the entry outlives the call.
      return serve(query, key, value, attn_mask, is_causal, scale, entry, (cache_key->flags & kNeedsGrad) != 0);
    }
  }
  // The decision (torch_flash_backend/_enable.py) is a Python kernel of this op;
  // the router keeps it here (routing_remember) for the next call.
  static const auto route = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("torch_flash_backend::route_sdpa", "")
                                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const std::optional<at::Tensor>&, double, bool,
                                                  std::optional<double>, bool, bool, bool)>();
  return route.call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, frame.strict, false);
}

}  // namespace
}  // namespace tfb

TORCH_LIBRARY_FRAGMENT(torch_flash_backend, m) {
  m.def("routing_lookup(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, bool is_causal, "
        "bool enable_gqa, float? scale, bool needs_grad, bool bottom_right, int window_left, int window_right, "
        "bool pinned) -> int",
        &tfb::routing_lookup);
  m.def("routing_remember(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, bool is_causal, "
        "bool enable_gqa, float? scale, bool needs_grad, bool bottom_right, int window_left, int window_right, "
        "bool pinned, bool served, str family, str backward_family, int decision) -> ()",
        &tfb::routing_remember);
  m.def("routing_invalidate() -> ()", &tfb::routing_invalidate);
  m.def("routing_counts() -> int[]", &tfb::routing_counts);
  m.def("routing_reset_counts() -> ()", &tfb::routing_reset_counts);
}

// Autograd keys see every call outside torch.inference_mode(); the backend keys
// see the calls made inside it, which skip autograd.
TORCH_LIBRARY_IMPL(aten, AutogradCPU, m) { m.impl("scaled_dot_product_attention", &tfb::sdpa); }
TORCH_LIBRARY_IMPL(aten, AutogradCUDA, m) { m.impl("scaled_dot_product_attention", &tfb::sdpa); }
TORCH_LIBRARY_IMPL(aten, CPU, m) { m.impl("scaled_dot_product_attention", &tfb::sdpa); }
TORCH_LIBRARY_IMPL(aten, CUDA, m) { m.impl("scaled_dot_product_attention", &tfb::sdpa); }
