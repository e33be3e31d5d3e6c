// The sm80 forward kernel: a CTA per (query tile, q head, batch).
#pragma once

#include "params.h"
#include "common/dropout.h"
#include "sm80/epilogue_fwd.h"
#include "common/grid.h"
#include "common/mask_summary.h"
#include "sm80/kernel_traits_fwd.h"
#include "sm80/mainloop_fwd.h"

namespace tfb {
namespace sm80 {

// One query tile, start to end: mainloop, softmax's finalize, epilogue.
// Returns false, without storing anything, when kExact is false and a row
// needed the exact softmax (common/softmax.h); every thread returns the same.
template <class Traits, class Policy, bool kExact, bool kDropout>
CUTE_DEVICE bool fwd_tile(AttnFwdParams const& p, char* smem, typename FwdMainloop<Traits, Policy>::Mask const& mask,
                          int m_block, int head, int batch) {
  typename Traits::TiledMma mma;
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{});
  clear(acc_o);
  OnlineSoftmax<Traits::kRowsPerThread> softmax;
  const bool inexact =
      FwdMainloop<Traits, Policy>::template run<kExact, kDropout>(p, smem, mask, m_block, head, batch, acc_o,
                                                                  softmax);
  if constexpr (!kExact) {
    if (__syncthreads_or(inexact)) return false;
  }
  Tensor o = acc_rowcol(acc_o);
  Tensor lse = softmax.finalize_rows(o, fabsf(p.scale), kDropout ? p.dropout.keep_scale : 1.f);
  FwdEpilogue<Traits>::store(p, smem, m_block, head, batch, acc_o, lse);
  return true;
}

// The exact pass, out of line: inlined, its registers and code would weigh on
// the fast pass's allocation (measured: the head dim 128 forward 4% slower).
// It takes scalars alone and builds its own mask: with the mask passed by
// reference the kernel kept a 136-byte stack frame, and the fast pass ran
// 2-4% slower (measured).
template <class Traits, class Policy, bool kDropout>
__noinline__ __device__ void fwd_tile_exact(AttnFwdParams const& p, char* smem, int m_block, int head, int batch) {
  const typename FwdMainloop<Traits, Policy>::Mask mask{
      mask::policy_of<Policy>(p, batch, head, p.seqlen_q(batch), p.seqlen_k(batch))};
  fwd_tile<Traits, Policy, true, kDropout>(p, smem, mask, m_block, head, batch);
}

// One CTA's work. kDropout: with dropout's draws (fwd_dropout_kernel); the
// plain kernel's code is the one it had before dropout existed (a copy of the
// tile beside it in one kernel cost that kernel 7-17% at E = 64 and 128).
template <class Traits, class Policy, bool kDropout>
CUTE_DEVICE void fwd_cta(AttnFwdParams const& p, char* smem) {
  if constexpr (kDropout) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) record_rng_state(p.dropout);
  }
  int head, batch;
  if (!HeadBatchGrid::locate(p.heads_q, p.batch, head, batch)) return;
  const typename FwdMainloop<Traits, Policy>::Mask mask{
      mask::policy_of<Policy>(p, batch, head, p.seqlen_q(batch), p.seqlen_k(batch))};
  // The grid covers the longest sequence (len_q); a packed batch's shorter ones have fewer tiles.
  if (int(blockIdx.x) >= mask.num_m_blocks()) return;
  // A band's tiles further down see more keys; launching them first shortens the tail.
  const int m_block = p.mask.right_bounded() ? mask.num_m_blocks() - 1 - int(blockIdx.x) : int(blockIdx.x);
  // The fast pass leaves rows whose scores reach 2^10 in exp2 units inexact;
  // if any did, the CTA starts over with the exact softmax. Such scores need
  // inputs near 1e5, so the second pass is there for correctness alone.
  if (!fwd_tile<Traits, Policy, false, kDropout>(p, smem, mask, m_block, head, batch)) {
    fwd_tile_exact<Traits, Policy, kDropout>(p, smem, m_block, head, batch);
  }
}

// Policy: mask.h Band, FromMemory or FromMemoryAdditive (mask_summary.h with_policy).
template <class Traits, class Policy>
__global__ void __launch_bounds__(Traits::kThreads) fwd_kernel(__grid_constant__ const AttnFwdParams p) {
  extern __shared__ __align__(128) char smem[];
  fwd_cta<Traits, Policy, false>(p, smem);
}

// The same with dropout (params.h DropoutArgs); a Band alone (no mask in memory).
template <class Traits, class Policy>
__global__ void __launch_bounds__(Traits::kThreads) fwd_dropout_kernel(__grid_constant__ const AttnFwdParams p) {
  extern __shared__ __align__(128) char smem[];
  fwd_cta<Traits, Policy, true>(p, smem);
}

}  // namespace sm80
}  // namespace tfb
