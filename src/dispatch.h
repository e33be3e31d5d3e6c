// Runtime (dtype, head dim) -> compile-time instantiation, for the families'
// api_*.cu, over the registry's head dims (kernel_list.h). A head dim left out
// of the build (TFB_HEAD_DIMS, which sets the TFB_WITH_HDIM* defines) is
// reported as missing and its launcher never named, so its symbol need not exist.
#pragma once

#include <type_traits>

#include <cuda_runtime_api.h>

#include <cutlass/numeric_types.h>

#include "kernel_list.h"
#include "params.h"

namespace tfb {

// Calls fn(Element{}, std::integral_constant<int, E>{}) for the one E among
// kHeadDims that equals head_dim and was built; returns whether it did.
template <int... kHeadDims, typename Fn>
bool visit_instantiation(DType dtype, int head_dim, Fn&& fn) {
  auto with_element = [&](auto element) {
    bool found = false;
    (
        [&] {
          if constexpr (head_dim_built(kHeadDims)) {
            if (head_dim == kHeadDims) {
              fn(element, std::integral_constant<int, kHeadDims>{});
              found = true;
            }
          }
        }(),
        ...);
    return found;
  };
  if (dtype == DType::kFloat8E4M3) return false;  // visit_fp8_instantiation's
  return dtype == DType::kFloat16 ? with_element(cutlass::half_t{}) : with_element(cutlass::bfloat16_t{});
}

// The same over a family's fp8_head_dims (e4m3 inputs): fn(cutlass::float_e4m3_t{}, E).
template <int... kHeadDims, typename Fn>
bool visit_fp8_instantiation(int head_dim, Fn&& fn) {
  bool found = false;
  (
      [&] {
        if constexpr (head_dim_built(kHeadDims)) {
          if (head_dim == kHeadDims) {
            fn(cutlass::float_e4m3_t{}, std::integral_constant<int, kHeadDims>{});
            found = true;
          }
        }
      }(),
      ...);
  return found;
}

// The launch of the instantiation visit_instantiation finds: launch(Element{},
// std::integral_constant<int, E>{}) returns its error; cudaErrorNotSupported
// when none was built for (dtype, head_dim). Every family's run_<pass>.
template <int... kHeadDims, typename Launch>
cudaError_t launch_instantiation(DType dtype, int head_dim, Launch&& launch) {
  cudaError_t err = cudaErrorNotSupported;
  visit_instantiation<kHeadDims...>(dtype, head_dim, [&](auto element, auto d) { err = launch(element, d); });
  return err;
}

}  // namespace tfb
