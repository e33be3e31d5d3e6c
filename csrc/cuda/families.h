// The CUDA kernels the ops launch, one entry per (family, pass) of the
// registry (src/kernel_list.h). The ops run the family the caller names (the
// ops' `family` argument, which is how the router's decision reaches the op)
// and check that it can: the router (torch_flash_backend/_router.py) is the one
// place that chooses.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

#include "device.h"
#include "kernel_info.h"
#include "params.h"

namespace tfb {

// One pass of one family: the entry points src/api.h declares for it.
template <class Params>
struct PassKernels {
  const char* family;
  const char* pass;
  int min_cc, max_cc;  // the registry's, major * 10 + minor; max_cc 0: no upper bound
  bool masks;          // the registry's: this pass reads a boolean attn_mask (params.mask.values)
  bool additive_masks;  // and an additive one
  bool windows;         // the registry's: this pass reads a band's left edge (window_left)
  bool seqlens;         // the registry's: this pass reads per-sequence lengths (params.seqlens)
  bool pads;            // the registry's: this pass serves smaller head dims (serving_head_dim)
  bool dropout;         // the registry's: this pass draws dropout (params.dropout)
  bool (*has)(DType, int);
  bool (*can_run)(const Params&);
  size_t (*workspace_bytes)(const Params&);
  cudaError_t (*run)(const Params&, DType, cudaStream_t);
  size_t (*smem_bytes)(DType, int);  // src/kernel_info.h: what built_kernels() reports
  TileShape (*tile)(DType, int);     // likewise

  // Whether the pass reads the call's mask: none, boolean or additive.
  bool reads_mask(bool masked, bool additive) const { return !masked || (additive ? additive_masks : masks); }
  bool runs_on(const DeviceInfo& info) const {
    const int cc = info.major * 10 + info.minor;
    return min_cc <= cc && (max_cc == 0 || cc <= max_cc);
  }
  // The built head dim that runs q/k of qk_dim columns and v of v_dim; 0: none.
  int serving_head_dim(DType dtype, int qk_dim, int v_dim) const;
  // "sm80_fwd_bf16_hdim128", as built_kernels() and the router spell it.
  std::string name(DType dtype, int head_dim) const;
};
using FwdKernels = PassKernels<AttnFwdParams>;
using BwdKernels = PassKernels<AttnBwdParams>;

// The kernels for these params: `family`'s (raising, naming it, when it has no
// such pass, no instantiation for the dtype and head dims, or cannot run on
// this device or these strides; raising when it is not given). Sets
// p.head_dim to the instantiation's (serving_head_dim).
const FwdKernels& forward_kernels(const std::optional<std::string_view>& family, const DeviceInfo& info,
                                  DType dtype, AttnFwdParams& p);
const BwdKernels& backward_kernels(const std::optional<std::string_view>& family, const DeviceInfo& info,
                                   DType dtype, AttnBwdParams& p);

// built_kernels()'s records, one per compiled instantiation:
// "<name> family=… pass=… dtype=… head_dim=… min_cc=… max_cc=… stride0_ok=… align_bytes=… smem_bytes=…
// tile_rows=… tile_keys=…".
std::vector<std::string> kernel_records();

}  // namespace tfb
