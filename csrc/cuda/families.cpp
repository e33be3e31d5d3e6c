#include "families.h"

#include <algorithm>
#include <cstring>

#include <c10/util/Exception.h>

#include "api.h"
#include "kernel_info.h"
#include "kernel_list.h"

namespace tfb {
namespace {

const char* dtype_name(DType dtype) {
  return dtype == DType::kFloat16 ? "fp16" : dtype == DType::kBFloat16 ? "bf16" : "fp8";
}

// The registry's limits of a family (TFB_KERNEL_FAMILIES), as built_kernels() prints them.
struct Limits {
  std::string_view family;
  int min_cc, max_cc;
  int align_bytes;
  // "min_cc=80 max_cc=0 stride0_ok=true align_bytes=16 max_rows=0 masks=fwd,bwd additive_masks=fwd,bwd
  // windows=fwd,bwd seqlens=fwd,bwd"
  const char* text;
  const char* masks;           // the passes that read a boolean attn_mask, comma-separated
  const char* additive_masks;  // those that read an additive one
  const char* windows;         // those that read a band's left edge
  const char* seqlens;         // those that read per-sequence lengths
  const char* pads;            // those that serve smaller head dims (serving_head_dim)
  const char* dropout;         // those that draw dropout
};
constexpr Limits kLimits[] = {
#define TFB_LIMITS(family, min_cc, max_cc, stride0_ok, align_bytes, max_rows, masks, additive_masks, windows, \
                   seqlens, pads, dropout, passes, head_dims)                                           \
  {#family, min_cc, max_cc, align_bytes,                                                                 \
   "min_cc=" #min_cc " max_cc=" #max_cc " stride0_ok=" #stride0_ok " align_bytes=" #align_bytes          \
   " max_rows=" #max_rows " masks=" masks " additive_masks=" additive_masks " windows=" windows          \
   " seqlens=" seqlens " pads=" pads " dropout=" dropout,                                                \
   masks, additive_masks, windows, seqlens, pads, dropout},
    TFB_KERNEL_FAMILIES(TFB_LIMITS)
#undef TFB_LIMITS
};

// Whether a comma-separated list names `item`.
bool lists(std::string_view csv, std::string_view item) {
  while (!csv.empty()) {
    const size_t comma = csv.find(',');
    if (csv.substr(0, comma) == item) return true;
    if (comma == std::string_view::npos) break;
    csv.remove_prefix(comma + 1);
  }
  return false;
}

const Limits& limits_of(std::string_view family) {
  for (const Limits& l : kLimits) {
    if (l.family == family) return l;
  }
  TORCH_CHECK(false, "kernel family ", family, " is missing from TFB_KERNEL_FAMILIES (src/kernel_list.h)");
}

struct Table {
  std::vector<FwdKernels> fwd;
  std::vector<BwdKernels> bwd;
};

// Built once from TFB_KERNEL_PASSES, in the registry's order of preference.
const Table& table() {
  static const Table t = [] {
    Table t;
    auto add = [](auto& list, const char* family, const char* pass, auto has, auto can_run, auto workspace_bytes,
                  auto run, size_t (*smem_bytes)(DType, int), TileShape (*tile)(DType, int)) {
      const Limits& l = limits_of(family);
      list.push_back({family, pass, l.min_cc, l.max_cc, lists(l.masks, pass), lists(l.additive_masks, pass),
                      lists(l.windows, pass), lists(l.seqlens, pass), lists(l.pads, pass), lists(l.dropout, pass), has,
                      can_run,
                      workspace_bytes, run, smem_bytes, tile});
    };
#define TFB_ADD_PASS(family, pass)                                                                    \
  add(t.pass, #family, #pass, &family::has_##pass, &family::can_run_##pass,                           \
      &family::pass##_workspace_bytes, &family::run_##pass, &family::smem_bytes_##pass, &family::tile_##pass);
    TFB_KERNEL_PASSES(TFB_ADD_PASS)
#undef TFB_ADD_PASS
    return t;
  }();
  return t;
}

template <class Params>
std::string built_names(const std::vector<PassKernels<Params>>& kernels, DType dtype, int head_dim) {
  std::string names;
  for (const auto& k : kernels) {
    if (k.has(dtype, head_dim)) names += (names.empty() ? "" : ", ") + k.name(dtype, head_dim);
  }
  return names.empty() ? "none" : names;
}

template <class Params>
std::string masked_families(const std::vector<PassKernels<Params>>& kernels, bool additive) {
  std::string names;
  for (const auto& k : kernels) {
    if (k.reads_mask(true, additive)) names += (names.empty() ? "" : ", ") + std::string(k.family);
  }
  const char* what = additive ? "an additive attn_mask" : "attn_mask";
  return names.empty() ? std::string("no family reads ") + what + " in this pass"
                       : std::string("families that read ") + what + ": " + names;
}

std::string cc_range(int min_cc, int max_cc) {
  auto cc = [](int v) { return std::to_string(v / 10) + "." + std::to_string(v % 10); };
  return max_cc == 0 ? cc(min_cc) + " and later" : min_cc == max_cc ? cc(min_cc) : cc(min_cc) + " to " + cc(max_cc);
}

// The family the caller named, when it runs the call; raises, naming the
// family and the reason, when it does not. The ops choose nothing: the router
// (torch_flash_backend/_router.py) chose the family from the same registry.
template <class Params>
const PassKernels<Params>& choose(const std::vector<PassKernels<Params>>& kernels, const char* pass,
                                  const std::optional<std::string_view>& family, const DeviceInfo& info,
                                  DType dtype, Params& p) {
  const bool masked = p.mask.in_memory();
  const bool additive = p.mask.mode == MaskMode::kAdditive;
  const bool window = p.mask.mode == MaskMode::kBand && p.mask.window_left >= 0;
  const bool per_batch_lengths = p.seqlens.cu_q || p.seqlens.cu_k || p.seqlens.used_k;
  std::string families;
  for (const auto& k : kernels) families += (families.empty() ? "" : ", ") + std::string(k.family);
  TORCH_CHECK(family.has_value(), "the CUDA ", pass, " op runs the family its caller names, and ",
              std::strcmp(pass, "forward") == 0 ? "family" : "the forward's backward_family",
              " is None (families: ", families, "; flash_attn() and enable() name the one the router chooses, "
              "which torch_flash_backend.explain() reports)");
  for (const auto& k : kernels) {
    if (k.family != *family) continue;
    const int head_dim = k.serving_head_dim(dtype, p.qk_dim, p.v_dim);
    TORCH_CHECK(head_dim > 0, "family='", *family, "' has no ", pass, " kernel for ", dtype_name(dtype),
                " head dims q/k ", p.qk_dim, ", v ", p.v_dim, " (built: ",
                built_names(kernels, dtype, std::max(p.qk_dim, p.v_dim)), k.pads ? "; smaller head dims that are "
                "multiples of 8 run on the next larger one" : "; it serves the head dims it was built for alone",
                ")");
    p.head_dim = head_dim;
    TORCH_CHECK(k.runs_on(info), "family='", *family, "' does not run on compute capability ", info.major, ".",
                info.minor, " (it runs on ", cc_range(k.min_cc, k.max_cc), ")");
    TORCH_CHECK(k.reads_mask(masked, additive), "family='", *family, "' has no ", pass, " kernel that reads ",
                additive ? "an additive" : "a boolean", " attn_mask (", masked_families(kernels, additive), ")");
    TORCH_CHECK(!window || k.windows, "family='", *family, "' has no ", pass,
                " kernel that reads a window's left edge (window_left)");
    TORCH_CHECK(!per_batch_lengths || k.seqlens, "family='", *family, "' has no ", pass,
                " kernel that reads per-sequence lengths (a packed variable-length batch or seqused_k)");
    TORCH_CHECK(!p.dropout.on() || k.dropout, "family='", *family, "' has no ", pass,
                " kernel that draws dropout (dropout_p > 0)");
    TORCH_CHECK(!p.dropout.on() || !masked, "dropout_p > 0 with attn_mask: no ", pass,
                " kernel draws dropout beside a mask in memory (beside is_causal or a window it does)");
    TORCH_CHECK(k.can_run(p), "family='", *family, "' cannot run these inputs (a stride of 0 from expand(), ",
                "a stride or pointer that is not a multiple of ", limits_of(k.family).align_bytes,
                " bytes, or, for a decode family, a query longer than it serves)");
    return k;
  }
  TORCH_CHECK(false, "family='", *family, "' has no CUDA ", pass, " kernels; these do: ", families);
}

}  // namespace

// The one rule for which instantiation serves a call's head dims (the
// router's _library.serving_kernel restates it for the records, and a test
// holds the two together): the same head dim where one was built; for a pass
// that pads, the smallest built one at least as large as both, when both are
// multiples of 8 (whole 16-byte vectors: the zero-filled columns never split
// one). 0: none.
template <class Params>
int PassKernels<Params>::serving_head_dim(DType dtype, int qk_dim, int v_dim) const {
  if (qk_dim == v_dim && has(dtype, qk_dim)) return qk_dim;
  if (!pads || qk_dim <= 0 || v_dim <= 0 || qk_dim % 8 != 0 || v_dim % 8 != 0) return 0;
  for (int d : {TFB_HEAD_DIMS_ALL}) {
    if (d >= std::max(qk_dim, v_dim) && has(dtype, d)) return d;
  }
  return 0;
}

template <class Params>
std::string PassKernels<Params>::name(DType dtype, int head_dim) const {
  return std::string(family) + "_" + pass + "_" + dtype_name(dtype) + "_hdim" + std::to_string(head_dim);
}
template struct PassKernels<AttnFwdParams>;
template struct PassKernels<AttnBwdParams>;

const FwdKernels& forward_kernels(const std::optional<std::string_view>& family, const DeviceInfo& info,
                                  DType dtype, AttnFwdParams& p) {
  return choose(table().fwd, "forward", family, info, dtype, p);
}

const BwdKernels& backward_kernels(const std::optional<std::string_view>& family, const DeviceInfo& info,
                                   DType dtype, AttnBwdParams& p) {
  return choose(table().bwd, "backward", family, info, dtype, p);
}

std::vector<std::string> kernel_records() {
  std::vector<std::string> lines;
  auto add = [&](const auto& kernels) {
    for (const auto& k : kernels) {
      for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3}) {
        for (int head_dim : {TFB_HEAD_DIMS_ALL}) {
          if (!k.has(dtype, head_dim)) continue;
          lines.push_back(k.name(dtype, head_dim) + " family=" + k.family + " pass=" + k.pass +
                          " dtype=" + dtype_name(dtype) + " head_dim=" + std::to_string(head_dim) + " " +
                          limits_of(k.family).text + " smem_bytes=" + std::to_string(k.smem_bytes(dtype, head_dim)) +
                          " tile_rows=" + std::to_string(k.tile(dtype, head_dim).rows) +
                          " tile_keys=" + std::to_string(k.tile(dtype, head_dim).keys));
        }
      }
    }
  };
  add(table().fwd);
  add(table().bwd);
  return lines;
}

}  // namespace tfb
