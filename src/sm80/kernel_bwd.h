// The main backward kernel: one CTA per (key block, kv head, batch).
#pragma once

#include <cute/tensor.hpp>

#include "params.h"
#include "sm80/epilogue_bwd.h"
#include "sm80/kernel_traits_bwd.h"
#include "sm80/mainloop_bwd.h"
#include "sm80/workspace_bwd.h"

namespace tfb::sm80::bwd {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) bwd_dkdv_kernel(const AttnBwdParams p, const BwdWorkspace ws) {
  using Element = typename Traits::Element;
  extern __shared__ __align__(128) char smem_raw[];
  Element* smem = reinterpret_cast<Element*>(smem_raw);
  const int tid = threadIdx.x;

  const BwdBlock blk(p, Traits::kBlockM, Traits::kBlockN);
  using TileKV = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;
  Tensor acc_dk = partition_fragment_C(typename Traits::TiledMmadKV{}, TileKV{});
  Tensor acc_dv = partition_fragment_C(typename Traits::TiledMmadKV{}, TileKV{});
  clear(acc_dk);
  clear(acc_dv);

  BwdMainloop<Traits>{smem, tid}.run(p, ws, blk, acc_dk, acc_dv);
  BwdEpilogue<Traits>{smem, tid}.store(p, blk, acc_dk, acc_dv);
}

}  // namespace tfb::sm80::bwd
