// The op schemas, declared once. Backends register their kernels beside their
// code (cpu/, cuda/); fake kernels and autograd live in torch_flash_backend/_fake.py and _autograd.py.
//
// Every tensor output is allocated in (B, L, H, E) memory order and returned as
// its (B, H, L, E) view, the layout FlashAttention-style kernels write fastest
// and the one Hugging Face models transpose back into without a copy. lse is a
// contiguous (B, H, L) float32 tensor. The fake kernels return the same strides.
#include <cstdio>
#include <utility>
#include <string>
#include <vector>

#include <torch/library.h>

#include "common/mask_values.h"
#include "kernel_list.h"
#ifdef TFB_WITH_CUDA
#include "cuda/families.h"
#endif

namespace {

// One line per family of the registry (src/registry.py): its name and limits.
std::vector<std::string> kernel_families() {
  std::vector<std::string> lines;
#define TFB_FAMILY_LINE(family, min_cc, max_cc, stride0_ok, align_bytes, max_rows, masks, additive_masks, windows, \
                        seqlens, pads, dropout, passes, head_dims)                                              \
  lines.push_back(std::string(#family) + " min_cc=" #min_cc " max_cc=" #max_cc " stride0_ok=" #stride0_ok          \
                  " align_bytes=" #align_bytes " max_rows=" #max_rows " masks=" masks                             \
                  " additive_masks=" additive_masks " windows=" windows " seqlens=" seqlens " pads=" pads         \
                  " dropout=" dropout " passes=" passes " head_dims=" head_dims);
  TFB_KERNEL_FAMILIES(TFB_FAMILY_LINE)
#undef TFB_FAMILY_LINE
  return lines;
}

// The numbers the Python package needs from the kernels' side, "name=value"
// with every digit a double has: read, never restated (one place per rule).
std::vector<std::string> constants() {
  const std::pair<const char*, double> values[] = {
      {"additive_limit", tfb::mask::kAdditiveLimit},
      {"additive_min_scale", tfb::mask::kAdditiveMinScale},
  };
  std::vector<std::string> lines;
  for (const auto& [name, value] : values) {
    // snprintf, not an ostringstream: a library built with a newer g++ than the
    // libstdc++ it loads beside crashed in the stream's locale code.
    char line[64];
    std::snprintf(line, sizeof(line), "%s=%.17g", name, value);
    lines.emplace_back(line);
  }
  return lines;
}

// One line per compiled instantiation, "<name> key=value ...": the family's
// limits and the shared memory a block needs, which the router reads.
std::vector<std::string> built_kernels() {
#ifdef TFB_WITH_CUDA
  return tfb::kernel_records();
#else
  return {};
#endif
}

}  // namespace

TORCH_LIBRARY(torch_flash_backend, m) {
  // family: the kernel family that runs the call ("sm90", "sm80"; "cpu" on
  // CPU), as the router chose it; its instantiation for the call's dtype and
  // head dim runs; the CUDA ops raise without one (csrc/cuda/families.h: they
  // check the choice, they do not make it). The forward carries the backward's choice too, for
  // its autograd formula. A family rather than an instantiation's name, so that
  // a graph traced with a symbolic head dim names a kernel too.
  // attn_mask: SDPA's boolean mask (True = take part) or additive mask (q's
  // dtype or float32, added to the scaled scores), broadcastable to
  // (B, Hq, L, S) and read in place; last, so that calls without one keep their
  // positions. The passes a family's registry entry lists in `masks` read a
  // boolean one, those in `additive_masks` an additive one.
  // bottom_right: is_causal's diagonal ends at the last key (row i sees keys
  // j <= i + S - L, torch.nn.attention.bias.causal_lower_right, PyTorch's
  // flash ops) instead of SDPA's top-left j <= i; rows before it see no key
  // and give 0. The same band when L == S. window_left / window_right: a
  // sliding window as FlashAttention's window_size (PyTorch's flash ops'
  // window_size_left / right), row i sees keys j with
  // i + d - window_left <= j <= i + d + window_right (d the diagonal's offset
  // as bottom_right places it; -1 opens a side; is_causal closes the right
  // side at the diagonal). Key tiles outside the band are never visited. Not
  // with attn_mask. Last, so that calls without them keep their positions.
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float? scale=None, bool is_causal=False, str? family=None,"
      " str? backward_family=None, Tensor? attn_mask=None, bool bottom_right=False, int window_left=-1,"
      " int window_right=-1) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,"
      " float? scale=None, bool is_causal=False, str? family=None, Tensor? attn_mask=None,"
      " bool bottom_right=False, int window_left=-1, int window_right=-1) -> (Tensor dq, Tensor dk, Tensor dv)");
  // fwd and bwd with dropout on P (SDPA's dropout_p, in (0, 1)): each (query,
  // key) pair dropped with probability dropout_p, the kept ones scaled by
  // 1 / (1 - dropout_p), drawn from PyTorch's CUDA generator
  // (src/common/dropout.h: torch.manual_seed reproduces a call, a CUDA graph's
  // replays draw anew). rng_state, int64 (2,), names the draws: the backward
  // regenerates the forward's mask from it, and dropout_mask returns it as a
  // bool (batch, heads, len_q, len_k) tensor (True = kept). CUDA alone.
  m.def(
      "dropout_fwd(Tensor q, Tensor k, Tensor v, float dropout_p, float? scale=None, bool is_causal=False,"
      " str? family=None, str? backward_family=None, Tensor? attn_mask=None, bool bottom_right=False,"
      " int window_left=-1, int window_right=-1) -> (Tensor out, Tensor lse, Tensor rng_state)");
  m.def(
      "dropout_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor rng_state,"
      " float dropout_p, float? scale=None, bool is_causal=False, str? family=None, Tensor? attn_mask=None,"
      " bool bottom_right=False, int window_left=-1, int window_right=-1) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("dropout_mask(Tensor rng_state, float dropout_p, int batch, int heads, int len_q, int len_k) -> Tensor");
  // A packed variable-length batch, as FlashAttention's varlen functions and
  // PyTorch's flash ops take it: q (total_q, Hq, E), k and v (total_k, Hkv, E);
  // sequence b's query rows are [cu_seq_q[b], cu_seq_q[b + 1]), its keys start
  // at cu_seq_k[b] and number seqused_k[b] if given, else up to cu_seq_k[b + 1]
  // (int32 offsets on q's device); max_q / max_k bound every sequence's
  // lengths. is_causal and the window are bottom-right aligned per sequence.
  // out is (total_q, Hq, E), lse (Hq, total_q) float32 (PyTorch's varlen
  // layout); rows no sequence covers give 0 (lse -inf).
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seq_q, Tensor cu_seq_k, SymInt max_q, SymInt max_k,"
      " float? scale=None, bool is_causal=False, str? family=None, str? backward_family=None,"
      " int window_left=-1, int window_right=-1, Tensor? seqused_k=None) -> (Tensor out, Tensor lse)");
  m.def(
      "varlen_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seq_q,"
      " Tensor cu_seq_k, SymInt max_q, SymInt max_k, float? scale=None, bool is_causal=False, str? family=None,"
      " int window_left=-1, int window_right=-1, Tensor? seqused_k=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  // FP8 attention (PyTorch's quantized flash ops): float8_e4m3fn q, k, v as
  // fwd / varlen_fwd take them, float32 descales of shape (batch, kv heads)
  // (none: 1) that turn the stored values into the meant ones, q's and k's
  // folded into the scores' scale and v's into O; O in bfloat16, lse of the
  // descaled scores. Forward alone; compute capability 9.0.
  m.def(
      "fp8_fwd(Tensor q, Tensor k, Tensor v, Tensor? q_descale=None, Tensor? k_descale=None,"
      " Tensor? v_descale=None, float? scale=None, bool is_causal=False, bool bottom_right=False)"
      " -> (Tensor out, Tensor lse)");
  m.def(
      "fp8_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seq_q, Tensor cu_seq_k, int max_q, int max_k,"
      " Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, float? scale=None,"
      " bool is_causal=False, Tensor? seqused_k=None) -> (Tensor out, Tensor lse)");
  // An SDPA call inside enable(): served by fwd or passed to PyTorch's SDPA, as
  // torch_flash_backend/_enable.py decides (its Python kernel); csrc/routing.cpp
  // sends aten::scaled_dot_product_attention here.
  m.def(
      "route_sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0,"
      " bool is_causal=False, float? scale=None, bool enable_gqa=False, bool strict=False,"
      " bool bottom_right=False) -> Tensor");
  // The compiled CUDA kernel instantiations, a line each: "sm80_fwd_bf16_hdim128
  // family=sm80 pass=fwd ..." (torch_flash_backend/_library.py reads them).
  m.def("built_kernels() -> str[]", &built_kernels);
  // The registry's families and their limits, whatever was built.
  m.def("kernel_families() -> str[]", &kernel_families);
  // The kernels' constants the Python side reads (the additive mask's limits).
  m.def("constants() -> str[]", &constants);
}
