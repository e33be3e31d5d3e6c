// End of a backward CTA: dK (times the softmax scale) and dV go from float
// registers through shared memory to global memory as 16-byte row stores,
// rows past the end of the keys left out.
#pragma once

#include <cute/tensor.hpp>

#include "params.h"
#include "sm80/kernel_traits_bwd.h"
#include "sm80/mainloop_bwd.h"
#include "sm80/utils_bwd.h"

namespace tfb::sm80::bwd {

template <class Traits>
struct BwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kN = Traits::kBlockN, kE = Traits::kHeadDim;

  Element* smem;
  int tid;

  template <class Acc>
  CUTE_DEVICE void stage(Acc const& acc, Element* s) const {
    Tensor r = convert_fragment<Element>(acc);
    auto r2s = make_tiled_copy_C(typename Traits::StoreFrag{}, typename Traits::TiledMmadKV{});
    auto thr = r2s.get_thread_slice(tid);
    Tensor dst = thr.partition_D(make_tensor(make_smem_ptr(s), typename Traits::SmemLayoutKV{}));
    copy(r2s, thr.retile_S(r), dst);
  }

  CUTE_DEVICE void write(Element* s, void* out, int64_t row_stride, int rows_valid, int cols) const {
    Tensor g = make_tensor(make_gmem_ptr(static_cast<Element*>(out)), Shape<Int<kN>, Int<kE>>{},
                           make_stride(row_stride, _1{}));
    store_tile<typename Traits::GmemStore>(make_tensor(make_smem_ptr(s), typename Traits::SmemLayoutKV{}), g,
                                           rows_valid, cols, tid);
  }

  template <class AccdK, class AccdV>
  CUTE_DEVICE void store(const AttnBwdParams& p, const BwdBlock& blk, AccdK& acc_dk, AccdV const& acc_dv) const {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.scale;
    // K and V are dead once every warp has left the last step.
    cp_async_wait<0>();
    __syncthreads();
    Element* sdK = smem + Traits::kOffK;
    Element* sdV = smem + Traits::kOffV;
    stage(acc_dk, sdK);
    stage(acc_dv, sdV);
    __syncthreads();
    const int n0 = blk.n_block * kN;
    Element* dk = static_cast<Element*>(p.dk) + p.dk_offset(blk.batch) + blk.head_kv * p.dk_head_stride +
                  n0 * p.dk_row_stride;
    Element* dv = static_cast<Element*>(p.dv) + p.dv_offset(blk.batch) + blk.head_kv * p.dv_head_stride +
                  n0 * p.dv_row_stride;
    write(sdK, dk, p.dk_row_stride, blk.len_k - n0, p.qk_dim);
    write(sdV, dv, p.dv_row_stride, blk.len_k - n0, p.v_dim);
  }
};

}  // namespace tfb::sm80::bwd
