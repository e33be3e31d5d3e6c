// The forward's epilogue: each consumer warpgroup sends its 64 rows of
// normalised O registers -> shared memory (stmatrix; O's own buffer, else
// Q's, or with FP8 the transposed V ring's bytes) -> global memory with one
// TMA store, which also drops the rows past the sequence end; the warpgroups
// wait for each other only in the V ring, which they all read to the end. The
// logsumexp goes straight from registers to global memory.
//
// In a packed batch the rows past a sequence's end are the next sequence's:
// a slab that holds them is stored by the warpgroup's threads, row by row.
#pragma once

#include <cute/tensor.hpp>

#include "sm90/mainloop_fwd.h"
#include "sm90/utils.h"

namespace tfb {
namespace sm90 {

template <class Traits>
struct FwdEpilogue {
  using Element = typename Traits::ElementOut;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;

  struct Params {
    typename Traits::TmaO tma_o;
    typename Traits::GmemShape shape_o;  // (L, E, Hq, B); packed: (total_q, E, Hq, 1)
    float* lse;                          // (B, Hq, L), contiguous; packed: (Hq, total_q)
    int64_t lse_head_stride;             // L; packed: total_q
    int heads_q;
    Element* o;                          // a packed batch's partial slabs: O's rows, row and head strides
    int64_t o_row_stride, o_head_stride;
    int o_cols;                          // O's head dim (params.h v_dim)
  };

  // rows: the batch's query length; lse is written for those rows alone.
  template <class AccO, class Lse, class Tile>
  CUTE_DEVICE static void store(Params const& p, typename Traits::SharedStorage& shared, AccO const& acc_o,
                                Lse const& lse, Tile const& tile, int rows, int thread_idx) {
    typename Traits::MmaO mma_o;
    auto thr_o = mma_o.get_thread_slice(thread_idx);
    const int warpgroup = thread_idx / 128;
    const int warpgroup_thread = thread_idx % 128;
    const int barrier = int(Barrier::kEpilogue) + warpgroup;

    // This warpgroup's slab is free once its previous store has read it (O's
    // own buffer) or once its last Q K^T has (Q's buffer): both are its own.
    // In the V ring's bytes (FP8) it is free once every consumer's last P V
    // has read them.
    constexpr bool kInVt = Traits::kOPlace == Traits::OPlace::kVt;
    constexpr bool kBorrowed = Traits::kOPlace != Traits::OPlace::kOwn;  // Q's or the V ring's bytes
    if (Traits::kSeparateO && warpgroup_thread == 0) tma_store_wait<0>();
    if constexpr (kInVt) {
      named_barrier_sync(int(Barrier::kOInVt), Traits::kConsumerThreads);
    } else {
      named_barrier_sync(barrier, 128);
    }
    // Q's buffer or the V ring's bytes: free for the next tile's Q or V once
    // this warpgroup's stores have read its slab.
    auto free_buffer = [&] {
      if constexpr (kInVt) {
        shared.o_free.arrive();
      } else if constexpr (!Traits::kSeparateO) {
        shared.q_free.arrive();
      }
    };
    Tensor sO = local_tile(make_tensor(make_smem_ptr(Traits::o_buffer(shared)), typename Traits::SmemLayoutO{}),
                           Shape<_64, Int<kHeadDim>>{}, make_coord(warpgroup, 0));
    Tensor o_regs = convert_fragment<Element>(acc_o);
    auto store_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, typename Traits::MmaPVWarpgroup{});
    auto thr_store = store_o.get_thread_slice(warpgroup_thread);
    copy(store_o, thr_store.retile_S(o_regs), thr_store.partition_D(sO));
    // stmatrix writes through the generic proxy; the TMA store reads through
    // the async proxy.
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(barrier, 128);

    const int slab = tile.m_block * Traits::kConsumerWarpgroups + warpgroup;
    const int slab_rows = rows - slab * 64;
    if (!kPackedTile<Tile> || slab_rows >= 64) {
      if (warpgroup_thread == 0) {
        Tensor mO = p.tma_o.get_tma_tensor(p.shape_o);
        Tensor gO = local_tile(tile.q_rows(mO, tile.head), Shape<_64, Int<kHeadDim>>{}, make_coord(slab, 0));
        auto thr_tma = p.tma_o.get_slice(0);
        copy(p.tma_o, thr_tma.partition_S(sO), thr_tma.partition_D(gO));
        tma_store_arrive();
        if constexpr (kBorrowed) {
          tma_store_wait<0>();
          free_buffer();
        }
      }
    } else if constexpr (kPackedTile<Tile>) {
      // 16-byte pieces, as the swizzled slab keeps them; O's columns alone.
      const int pieces = p.o_cols / 8;
      Element* o_rows = p.o + (int64_t(tile.q_row0) + slab * 64) * p.o_row_stride + tile.head * p.o_head_stride;
      for (int i = warpgroup_thread; i < slab_rows * pieces; i += 128) {
        const int r = i / pieces, c = (i % pieces) * 8;
        *reinterpret_cast<uint4*>(o_rows + r * p.o_row_stride + c) = *reinterpret_cast<const uint4*>(&sO(r, c));
      }
      if constexpr (kBorrowed) {
        named_barrier_sync(barrier, 128);
        if (warpgroup_thread == 0) free_buffer();
      }
    }

    // The lane of each quad that holds column 0 writes its rows' logsumexp.
    Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor coord = make_tensor(cO.data(), acc_rowcol_layout(cO.layout()));
    static_assert(decltype(size<0>(coord))::value == decltype(size(lse))::value);
    if (get<1>(coord(0, 0)) == 0) {
      const int m0 = tile.m_block * kBlockM;
      float* lse_rows = kPackedTile<Tile> ? p.lse + tile.head * p.lse_head_stride + row0_of(tile)
                                          : p.lse + (int64_t(tile.batch) * p.heads_q + tile.head) * p.lse_head_stride;
#pragma unroll
      for (int r = 0; r < size<0>(coord); ++r) {
        const int row = m0 + get<0>(coord(r, 0));
        if (row < rows) lse_rows[row] = lse(r);
      }
    }
  }

  template <class Tile>
  CUTE_DEVICE static int64_t row0_of(Tile const& tile) {
    if constexpr (kPackedTile<Tile>) {
      return tile.q_row0;
    } else {
      return 0;
    }
  }
};

}  // namespace sm90
}  // namespace tfb
