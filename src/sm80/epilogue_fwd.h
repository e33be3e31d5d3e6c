// Writes a CTA's normalised output tile and its float32 logsumexp. O goes
// registers -> shared (Q's buffer) -> global so that global stores are whole
// 16-byte row segments rather than the MMA's scattered 4-byte pairs.
#pragma once

#include "params.h"
#include "sm80/kernel_traits_fwd.h"
#include "sm80/utils.h"

namespace tfb {
namespace sm80 {

template <class Traits>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;

  template <class AccO, class Lse>
  CUTE_DEVICE static void store(AttnFwdParams const& p, char* smem, int m_block, int head, int batch,
                                AccO const& acc_o, Lse const& lse) {
    const int tid = threadIdx.x;
    const int m0 = m_block * kBlockM;
    const int len_q = p.seqlen_q(batch);
    using TileO = Shape<Int<kBlockM>, Int<kHeadDim>>;
    typename Traits::TiledMma mma;
    auto thr_mma = mma.get_thread_slice(tid);

    // The quad lane holding column 0 of a row writes that row's lse.
    Tensor coord = thr_mma.partition_C(make_identity_tensor(TileO{}));
    Tensor coord_rc = acc_rowcol(coord);
    static_assert(decltype(size<0>(coord_rc))::value == decltype(size(lse))::value);
    if (get<1>(coord_rc(0, 0)) == 0) {
      float* lse_rows = p.lse + p.lse_offset(batch, head);
#pragma unroll
      for (int r = 0; r < size(lse); ++r) {
        const int row = m0 + get<0>(coord_rc(r, 0));
        if (row < len_q) lse_rows[row] = lse(r);
      }
    }

    // Registers -> shared. The mainloop's last barrier came after every
    // thread's last read of Q, so its buffer is free.
    Tensor rO = convert_fragment<Element>(acc_o);
    Tensor sO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutO{});
    auto copy_o = make_tiled_copy_C(typename Traits::SmemCopyO{}, mma);
    auto thr_copy_o = copy_o.get_thread_slice(tid);
    copy(copy_o, thr_copy_o.retile_S(rO), thr_copy_o.partition_D(sO));
    __syncthreads();

    // Shared -> global, rows past the sequence end left alone.
    auto o_ptr = static_cast<Element*>(p.o) + p.o_offset(batch) + head * p.o_head_stride;
    Tensor mO = make_tensor(make_gmem_ptr(o_ptr), make_shape(len_q, Int<kHeadDim>{}),
                            make_stride(p.o_row_stride, _1{}));
    Tensor gO = local_tile(mO, TileO{}, make_coord(m_block, 0));
    typename Traits::GmemStore gmem_store;
    auto thr_store = gmem_store.get_thread_slice(tid);
    Tensor tOsO = thr_store.partition_S(sO);
    Tensor tOgO = thr_store.partition_D(gO);
    Tensor tOcO = thr_store.partition_D(make_identity_tensor(TileO{}));
    Tensor tOrO = make_tensor<Element>(shape(tOgO));
    copy(gmem_store, tOsO, tOrO);
    copy_rows_guarded(gmem_store, tOrO, tOgO, tOcO, len_q - m0, p.v_dim);
  }
};

}  // namespace sm80
}  // namespace tfb
