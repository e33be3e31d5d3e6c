// The backward's main loop, in its two roles, for one key tile of one kv head.
//
// load(): the producer warp (its lane 0 issuing) loads K and V once, then
// streams each step's Q with its rows' lse, and dO with its rows' rowsum(dO *
// O), through a kStages-deep ring (TMA for the tiles, a bulk copy for the row
// statistics, both completing on the stage's mbarrier); with a mask in memory
// it also tells the consumers each stage's step (ConsumerSteps).
//
// compute(): each consumer warpgroup, per step (one query tile of one query
// head), computes S^T and dP^T for its 64 keys, P^T = exp2(S^T scale - lse)
// and dS^T = P^T (dP^T - D) in registers, adds P^T dO into dV and dS^T Q into
// dK straight from those registers, and writes dS^T to shared memory; then
// the warpgroups together compute dQ = dS K for the query tile and one thread
// adds it into the float32 accumulator in global memory with one bulk
// reduction, which runs while the next step computes.
// A tile (tile_scheduler.h WorkTile, or a packed batch's PackedTile) says where a batch's rows are.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/dropout.h"
#include "common/mask.h"
#include "common/mask_apply.h"
#include "common/workspace_bwd.h"
#include "params.h"
#include "sm90/kernel_traits_bwd.h"
#include "sm90/mask_walk.h"
#include "sm90/softmax_bwd.h"
#include "sm90/steps_bwd.h"
#include "sm90/tile_scheduler.h"
#include "sm90/utils.h"

namespace tfb {
namespace sm90 {

// Policy: a band (mask.h Band) or a boolean mask in
// memory (FromMemory), whose hidden tiles both roles skip.
template <class Traits, class Policy = mask::Band>
struct BwdMainloop {
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename cutlass::PipelineState<Traits::kStages>;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using Mask = mask::TileWalk<kBlockM, kBlockN, Policy>;

  struct Params {
    typename Traits::TmaQ tma_q;
    typename Traits::TmaQ tma_do;
    typename Traits::TmaKV tma_k;
    typename Traits::TmaKV tma_v;
    typename Traits::GmemShape shape_q;  // (L, E, Hq, B)
    typename Traits::GmemShape shape_k;  // (S, E, Hkv, B)
    int group;
    int heads_q;
    float scale_log2;
    int len_q_pad;           // rows of each (batch, head) in the workspace arrays
    float const* lse_log2;   // (B, Hq, len_q_pad); a packed batch: (Hq, head_rows) (workspace_bwd.h)
    float const* dsum;       // likewise
    float* dq_accum;         // (splits, B, Hq, len_q_pad, E), query tiles in BwdTraits' fragment order
    int64_t split_elems;
    bool deterministic;      // one split per CTA column, reductions one at a time
    SeqLens seqlens;         // a packed batch's, whose sequence b starts packed_row0(b) rows into a head's
    int64_t head_rows;
    DropoutArgs dropout;
  };

  // The workspace row of query tile m_block's first row.
  template <class Tile>
  CUTE_DEVICE static int64_t stat_offset(Params const& p, Tile const& tile, int head_q, int m_block) {
    if constexpr (kPackedTile<Tile>) {
      return head_q * p.head_rows + packed_row0(p.seqlens, tile.batch) + int64_t(m_block) * kBlockM;
    } else {
      return (int64_t(tile.batch) * p.heads_q + head_q) * p.len_q_pad + int64_t(m_block) * kBlockM;
    }
  }

  // A packed tile's rows past its sequence's end (the last key tile's, each
  // last query tile's) are the next sequence's: every consumer clears them
  // once they land (utils.h clear_rows_from), before any wgmma reads them.
  CUTE_DEVICE static void foreign_cleared() {
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(int(BwdBarrier::kConsumers), Traits::kConsumerThreads);
  }
  // The key tile's K and V (after kv_full), once per key tile.
  template <class Tile>
  CUTE_DEVICE static void clear_foreign_kv(SharedStorage& shared, Tile const& tile, int n_block, int thread_idx) {
    if constexpr (kPackedTile<Tile>) {
      const int keys = tile.len_k - n_block * kBlockN;
      if (keys >= kBlockN) return;
      constexpr int kThreads = Traits::kConsumerThreads;
      clear_rows_from<kThreads>(make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{}), keys,
                                thread_idx);
      clear_rows_from<kThreads>(make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{}), keys,
                                thread_idx);
      foreign_cleared();
    }
  }
  // A step's Q and dO stage, waited for here.
  template <class Tile>
  CUTE_DEVICE static void clear_foreign_q(SharedStorage& shared, Pipeline& pipeline_q, Pipeline& pipeline_do,
                                          PipelineState const& read, Tile const& tile, int m_block, int thread_idx) {
    if constexpr (kPackedTile<Tile>) {
      const int queries = tile.len_q - m_block * kBlockM;
      if (queries >= kBlockM) return;
      pipeline_q.consumer_wait(read);
      pipeline_do.consumer_wait(read);
      Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
      Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutQ{});
      clear_rows_from<Traits::kConsumerThreads>(sQ(_, _, read.index()), queries, thread_idx);
      clear_rows_from<Traits::kConsumerThreads>(sdO(_, _, read.index()), queries, thread_idx);
      foreign_cleared();
    }
  }

  // The producer's walk over a key tile's steps: a mask in memory skips the
  // tiles it hides, read through a KindCursor (mask_walk.h) by the whole
  // producer warp, 32 kinds a load (one thread's 8 at a time left the
  // consumers waiting at each key tile's start and, for its end note, past
  // its last visited step).
  template <class Masks>
  struct StepCursor {
    static constexpr bool kSkips = mask::kReadsMemory<Policy>;
    struct KindAt {
      BwdSteps const& steps;
      Masks const& masks;
      int batch, n_block;
      CUTE_DEVICE mask::TileKind operator()(int i) const {
        const auto step = steps.at(i);
        return masks.mask(batch, step.head_q).policy.kind(step.m_block, n_block);
      }
    };
    KindCursor<true, KindAt> kinds;
    int n_block;

    CUTE_DEVICE StepCursor(BwdSteps const& steps, Masks const& masks, int batch, int n_block_)
        : kinds(KindAt{steps, masks, batch, n_block_}, steps.count), n_block(n_block_) {}

    // The first visited step at or after i (steps.count or more: none).
    CUTE_DEVICE int next(int i) {
      if constexpr (kSkips) {
        return kinds.next(i);
      } else {
        return i;
      }
    }
    // Whether visited step i needs the per-element pass (a mask in memory).
    CUTE_DEVICE bool partial(Mask const& mask, int i) const {
      return kinds.partial_at(i) || mask.past_len_k(n_block);
    }
  };

  using Step = ConsumerStep;
  template <class Masks>
  using Steps = ConsumerSteps<mask::kReadsMemory<Policy>, Masks>;

  // Producer: one warp, whose lane 0 (the pipelines' leader) issues the
  // loads. unit: this CTA's how-many-th key tile (phase of kv_full).
  // masks: anything with mask(batch, head_q) -> Mask (the kernel's params).
  template <class Masks, class Tile>
  CUTE_DEVICE static void load(Params const& p, SharedStorage& shared, Pipeline& pipeline_q, Pipeline& pipeline_do,
                               PipelineState& write, BwdSteps const& steps, Masks const& masks, int n_block,
                               int head_kv, Tile const& tile, int unit) {
    const int batch = tile.batch;
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
    Tensor mdO = p.tma_do.get_tma_tensor(p.shape_q);
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_k);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_k);
    using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
    using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;

    const bool issues = threadIdx.x == 0;
    // K and V of the previous key tile stay until every consumer is done.
    if (unit > 0) shared.kv_free.wait((unit - 1) & 1);
    Tensor gK = local_tile(tile.k_rows(mK, head_kv), TileKV{}, make_coord(n_block, 0));
    Tensor gV = local_tile(tile.k_rows(mV, head_kv), TileKV{}, make_coord(n_block, 0));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    if (issues) {
      shared.kv_full.arrive_and_expect_tx(2 * Traits::kKVBytes);
      copy(p.tma_k.with(reinterpret_cast<uint64_t&>(shared.kv_full)), tKgK, tKsK);
      copy(p.tma_v.with(reinterpret_cast<uint64_t&>(shared.kv_full)), tVgV, tVsV);
    }

    StepCursor<Masks> cursor(steps, masks, batch, n_block);
    constexpr bool kNotes = Steps<Masks>::kNotes;
    for (int i = cursor.next(0); i < steps.count; i = cursor.next(i + 1)) {
      const auto step = steps.at(i);
      Tensor gQ = local_tile(tile.q_rows(mQ, step.head_q), TileQ{}, make_coord(step.m_block, 0));
      Tensor gdO = local_tile(tile.q_rows(mdO, step.head_q), TileQ{}, make_coord(step.m_block, 0));
      auto [tQgQ, tQsQ] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tdOgdO, tdOsdO] =
          tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      const int64_t stat = stat_offset(p, tile, step.head_q, step.m_block);

      if constexpr (kNotes) {
        const bool partial = cursor.partial(masks.mask(batch, step.head_q), i);
        shared.pipeline_q.empty_barrier_[write.index()].wait(write.phase());
        if (issues) shared.notes[write.index()] = {step.m_block, step.head_q, int(partial)};
        pipeline_q.producer_acquire(write, {cutlass::BarrierStatus::WaitDone});
      } else {
        pipeline_q.producer_acquire(write);
      }
      if (issues) {
        uint64_t* q_bar = pipeline_q.producer_get_barrier(write);
        copy(p.tma_q.with(*q_bar), tQgQ, tQsQ(_, write.index()));
        SM90_BULK_COPY_G2S::copy(p.lse_log2 + stat, q_bar, shared.lse[write.index()], Traits::kStatBytes);
      }
      pipeline_do.producer_acquire(write);
      if (issues) {
        uint64_t* do_bar = pipeline_do.producer_get_barrier(write);
        copy(p.tma_do.with(*do_bar), tdOgdO, tdOsdO(_, write.index()));
        SM90_BULK_COPY_G2S::copy(p.dsum + stat, do_bar, shared.dsum[write.index()], Traits::kStatBytes);
      }
      ++write;
    }
    if constexpr (kNotes) {  // the key tile's end: a stage of both pipelines with no loads
      const int stage = write.index();
      shared.pipeline_q.empty_barrier_[stage].wait(write.phase());
      shared.pipeline_do.empty_barrier_[stage].wait(write.phase());
      if (issues) {
        shared.notes[stage] = {-1, 0, 0};
        shared.pipeline_q.full_barrier_[stage].arrive();
        shared.pipeline_do.full_barrier_[stage].arrive();
      }
      ++write;
    }
  }

  // One step's S^T = K Q^T and dP^T = V dO^T, each issued once its stage has
  // landed, then P^T and dS^T in their place (softmax_bwd.h softmax_grad). A mask in
  // memory's bits load first: their latency overlaps dO's wait and the MMAs.
  // kQueries: the slice's queries (coord's second extent).
  template <int kQueries, bool kDropout, class Mma, class FragKV, class FragQ, class Acc, class Coord>
  CUTE_DEVICE static void scores_and_grads(Params const& p, SharedStorage& shared, Pipeline& pipeline_q,
                                           Pipeline& pipeline_do, PipelineState const& read, Mma& mma,
                                           FragKV const& tSrK, FragKV const& tSrV, FragQ const& tSrQ,
                                           FragQ const& tSrdO, Acc& acc_s, Acc& acc_dp, Coord const& coord,
                                           Mask const& mask, bool predicate, int batch, int head_q, int m_block,
                                           int n_block, int q0, int k0) {
    uint32_t pieces[(kQueries + 31) / 32];
    if constexpr (mask::kReadsMemory<Policy>) {
      if (predicate) {
        mask::load_bit_pieces<kBlockN, kQueries>(mask.policy, m_block * kBlockM + q0, n_block * kBlockN + k0,
                                                 get<0>(coord(0, 0)) / 16, threadIdx.x % 32, pieces);
      }
    }
    const int stage = read.index();
    pipeline_q.consumer_wait(read);
    wgmma<true, -1>(mma, tSrK, tSrQ(_, _, _, stage), acc_s);
    pipeline_do.consumer_wait(read);
    wgmma<true, -1>(mma, tSrV, tSrdO(_, _, _, stage), acc_dp);
    softmax_grad<kBlockM, kBlockN, Policy, kDropout>(p, acc_s, acc_dp, coord, shared.lse[stage], shared.dsum[stage],
                                                     mask, predicate, pieces, batch, head_q, m_block, n_block, q0, k0);
  }

  // Warpgroup w's share of dQ = dS K (BwdTraits::DqSlice), its wgmma waited
  // for, then after(), then the values staged in its fragment order
  // (BwdTraits::dq_index).
  template <int w, class SdS, class SKt, class After>
  CUTE_DEVICE static void dq_slice(SdS const& sdS, SKt const& sKt, float* staged, int wg_thread, After&& after) {
    using Slice = typename Traits::template DqSlice<w>;
    typename Slice::Mma mma;
    auto thr = mma.get_thread_slice(wg_thread);
    Tensor tdQrdS = thr.partition_fragment_A(local_tile(sdS, Shape<_64, Int<kBlockN>>{}, make_coord(Slice::kRow0 / 64, 0)));
    Tensor tdQrK = thr.partition_fragment_B(
        local_tile(sKt, Shape<Int<Slice::kCols>, Int<kBlockN>>{}, make_coord(Slice::kCol0 / Slice::kCols, 0)));
    Tensor acc = partition_fragment_C(mma, Shape<_64, Int<Slice::kCols>>{});
    wgmma<true, -1>(mma, tdQrdS, tdQrK, acc);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    after();
    float* mine = staged + Slice::kOffset;
    static_assert(Traits::kDqVec == 4 && size(acc) % 4 == 0, "runs of four values: one 16-byte store each");
    CUTE_UNROLL
    for (int j = 0; j < size(acc); j += 4) {
      *reinterpret_cast<float4*>(mine + Traits::dq_index(j, wg_thread)) =
          make_float4(acc(j), acc(j + 1), acc(j + 2), acc(j + 3));
    }
  }

  // Consumer: one warpgroup's 64 keys of the tile. Leaves dK (unscaled) and
  // dV in its accumulators. thread_idx counts the consumer threads from 0.
  // masks: as load()'s; the steps it skips are load()'s.
  template <bool kDropout, class Masks, class Tile, class AccdK, class AccdV>
  CUTE_DEVICE static void compute(Params const& p, SharedStorage& shared, Pipeline& pipeline_q,
                                  Pipeline& pipeline_do, PipelineState& read, BwdSteps const& steps,
                                  Masks const& masks, int n_block, Tile const& tile, int unit, float* dq_split,
                                  int thread_idx, AccdK& acc_dk, AccdV& acc_dv) {
    const int batch = tile.batch;
    // Warp-uniform by a shuffle, so that the shared-memory descriptors built
    // from it live in uniform registers (else each wgmma's is moved there).
    const int warpgroup = __shfl_sync(0xffffffffu, thread_idx / 128, 0);
    const int wg_thread = thread_idx % 128;
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutQt{});
    Tensor sK = local_tile(make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{}),
                           Shape<_64, Int<kHeadDim>>{}, make_coord(warpgroup, 0));
    Tensor sV = local_tile(make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{}),
                           Shape<_64, Int<kHeadDim>>{}, make_coord(warpgroup, 0));
    Tensor sdS = make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutdS{});
    Tensor sdSt = local_tile(make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutdSt{}),
                             Shape<_64, Int<kBlockM>>{}, make_coord(warpgroup, 0));
    Tensor sKt = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKt{});

    typename Traits::MmaSdP mma_sdp;
    typename Traits::MmadKV mma_dkv;
    auto thr_sdp = mma_sdp.get_thread_slice(wg_thread);
    auto thr_dkv = mma_dkv.get_thread_slice(wg_thread);
    Tensor tSrK = thr_sdp.partition_fragment_A(sK);
    Tensor tSrV = thr_sdp.partition_fragment_A(sV);
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);
    Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
    Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt);
    Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);
    // dS^T to shared memory by stmatrix (8 x 8 tiles, queries contiguous): an
    // element-wise copy through the swizzled pointer became 16 generic stores
    // a step with a 64-bit address each; 4 stmatrix took the backward 2-11%
    // faster at head dims 64-128 (benchmarks/history/2026-11-v9-v27.md, v24), and the kernel
    // that reads a mask 4% once its consumers held no step cursor (v27).
    auto store_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_store_ds = store_ds.get_thread_slice(wg_thread);
    Tensor tdSsdS = thr_store_ds.partition_D(sdSt);
    // (key, query) of each S^T element, within this warpgroup's 64 keys.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<_64, Int<kBlockM>>{}));
    Tensor coord = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));

    const bool leader = thread_idx == 0;
    constexpr int kConsumers = Traits::kConsumerThreads;

    shared.kv_full.wait(unit & 1);
    clear_foreign_kv(shared, tile, n_block, thread_idx);
    Steps<Masks> walk{steps, masks, batch, n_block};
    Step step;
    while (walk.take(shared, pipeline_q, pipeline_do, read, step)) {
      const int stage = read.index();
      clear_foreign_q(shared, pipeline_q, pipeline_do, read, tile, step.m_block, thread_idx);

      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<_64, Int<kBlockM>>{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<_64, Int<kBlockM>>{});
      scores_and_grads<kBlockM, kDropout>(p, shared, pipeline_q, pipeline_do, read, mma_sdp, tSrK, tSrV, tSrQ, tSrdO,
                                          acc_s, acc_dp, coord, masks.mask(batch, step.head_q), step.predicate, batch,
                                          step.head_q, step.m_block, n_block, 0, warpgroup * 64);

      Tensor p_regs = convert_fragment<Element>(acc_s);
      Tensor tdVrP = make_tensor(p_regs.data(), acc_as_a_operand_layout(p_regs.layout()));
      Tensor ds_regs = convert_fragment<Element>(acc_dp);
      Tensor tdKrdS = make_tensor(ds_regs.data(), acc_as_a_operand_layout(ds_regs.layout()));
      wgmma<false, -1>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), acc_dv);
      wgmma<false, -1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), acc_dk);

      // dS^T into shared memory for dQ, while dV and dK run.
      copy(store_ds, thr_store_ds.retile_S(ds_regs), tdSsdS);
      cutlass::arch::fence_view_async_shared();
      // The previous step's reduction has read the dQ buffer before anyone
      // writes it again; in the deterministic mode it has also landed.
      if (leader) {
        if (p.deterministic) {
          asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
        } else {
          tma_store_wait<0>();
        }
      }
      named_barrier_sync(int(BwdBarrier::kConsumers), kConsumers);

      // This warpgroup's share of dQ = dS K, staged for the reduction; the
      // stage's Q and dO are free once its wgmmas (dV and dK too) complete.
      auto release = [&] {
        warpgroup_fence_operand(acc_dv);
        warpgroup_fence_operand(acc_dk);
        pipeline_q.consumer_release(read);
        pipeline_do.consumer_release(read);
        ++read;
      };
      if (warpgroup == 0) {
        dq_slice<0>(sdS, sKt, shared.dq.data(), wg_thread, release);
      } else {
        dq_slice<1>(sdS, sKt, shared.dq.data(), wg_thread, release);
      }
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(int(BwdBarrier::kConsumers), kConsumers);
      if (leader) {
        const int64_t dq_tile = stat_offset(p, tile, step.head_q, step.m_block) * kHeadDim;
        bulk_reduce_add(dq_split + dq_tile, shared.dq.data(), Traits::kDqElems * int(sizeof(float)));
        tma_store_arrive();
      }
    }
  }

  // Consumer, split-dim variant (BwdTraits::kSplitDim): warpgroup w computes
  // S^T and dP^T for the tile's 64 keys and its half of the query tile, writes
  // P^T and dS^T to shared memory, then dV, dK (left in its accumulators) and
  // dQ for its half of the head dim, and adds dQ into the float32 accumulator.
  template <bool kDropout, class Masks, class Tile, class AccdK, class AccdV>
  CUTE_DEVICE static void compute_split_dim(Params const& p, SharedStorage& shared, Pipeline& pipeline_q,
                                            Pipeline& pipeline_do, PipelineState& read, BwdSteps const& steps,
                                            Masks const& masks, int n_block, Tile const& tile, int unit,
                                            float* dq_split, int thread_idx, AccdK& acc_dk, AccdV& acc_dv) {
    const int batch = tile.batch;
    static_assert(Traits::kSplitDim);
    constexpr int kQueries = Traits::kSdPQueries;
    constexpr int kCols = Traits::kDkvCols;
    constexpr int kStages = Traits::kStages;
    // Warp-uniform by a shuffle, so that the shared-memory descriptors built
    // from it live in uniform registers (else each wgmma's is moved there).
    const int warpgroup = __shfl_sync(0xffffffffu, thread_idx / 128, 0);
    const int wg_thread = thread_idx % 128;
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutQt{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
    Tensor sKt = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKt{});
    // (key, query, buffer) and (query, key, buffer).
    Tensor sPt = make_tensor(make_smem_ptr(shared.p.data()), typename Traits::SmemLayoutPdStBuf{});
    Tensor sdSt = make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutPdStBuf{});
    Tensor sdS = make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutdSBuf{});
    // This warpgroup's queries (scores) and head-dim columns (dK, dV, dQ).
    using QueryHalf = Shape<Int<kQueries>, Int<kHeadDim>, Int<kStages>>;
    using ColsQ = Shape<Int<kCols>, Int<kBlockM>, Int<kStages>>;
    Tensor sQ_mine = local_tile(sQ, QueryHalf{}, make_coord(warpgroup, 0, 0));
    Tensor sdO_mine = local_tile(sdO, QueryHalf{}, make_coord(warpgroup, 0, 0));
    Tensor sQt_mine = local_tile(sQt, ColsQ{}, make_coord(warpgroup, 0, 0));
    Tensor sdOt_mine = local_tile(sdOt, ColsQ{}, make_coord(warpgroup, 0, 0));
    Tensor sKt_mine = local_tile(sKt, Shape<Int<kCols>, Int<kBlockN>>{}, make_coord(warpgroup, 0));

    typename Traits::MmaSdP mma_sdp;
    typename Traits::MmadKV mma_dkv;
    using Slice = typename Traits::template DqSlice<0>;  // both halves have its shape
    typename Slice::Mma mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(wg_thread);
    auto thr_dkv = mma_dkv.get_thread_slice(wg_thread);
    auto thr_dq = mma_dq.get_thread_slice(wg_thread);
    Tensor tSrK = thr_sdp.partition_fragment_A(sK);
    Tensor tSrV = thr_sdp.partition_fragment_A(sV);
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ_mine);
    Tensor tSrdO = thr_sdp.partition_fragment_B(sdO_mine);
    Tensor tdVrP = thr_dkv.partition_fragment_A(sPt);
    Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt_mine);
    Tensor tdKrdS = thr_dkv.partition_fragment_A(sdSt);
    Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt_mine);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
    Tensor tdQrK = thr_dq.partition_fragment_B(sKt_mine);
    using MyQueries = Shape<_64, Int<kQueries>, Int<Traits::kPdSBuffers>>;
    Tensor tPsP = thr_sdp.partition_C(local_tile(sPt, MyQueries{}, make_coord(0, warpgroup, 0)));
    Tensor tdSsdS = thr_sdp.partition_C(local_tile(sdSt, MyQueries{}, make_coord(0, warpgroup, 0)));
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<_64, Int<kQueries>>{}));
    Tensor coord = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));
    constexpr int kConsumers = Traits::kConsumerThreads;

    int done = 0;  // steps computed: P^T and dS^T alternate buffers
    shared.kv_full.wait(unit & 1);
    clear_foreign_kv(shared, tile, n_block, thread_idx);
    Steps<Masks> walk{steps, masks, batch, n_block};
    Step step;
    while (walk.take(shared, pipeline_q, pipeline_do, read, step)) {
      const int stage = read.index();
      clear_foreign_q(shared, pipeline_q, pipeline_do, read, tile, step.m_block, thread_idx);

      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<_64, Int<kQueries>>{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<_64, Int<kQueries>>{});
      scores_and_grads<kQueries, kDropout>(p, shared, pipeline_q, pipeline_do, read, mma_sdp, tSrK, tSrV, tSrQ,
                                           tSrdO, acc_s, acc_dp, coord, masks.mask(batch, step.head_q), step.predicate,
                                           batch, step.head_q, step.m_block, n_block, warpgroup * kQueries, 0);
      Tensor p_regs = convert_fragment<Element>(acc_s);
      Tensor ds_regs = convert_fragment<Element>(acc_dp);

      const int buf = done++ % 2;
      copy(p_regs, tPsP(_, _, _, buf));
      copy(ds_regs, tdSsdS(_, _, _, buf));
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(int(BwdBarrier::kConsumers), kConsumers);

      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<_64, Int<kCols>>{});
      wgmma<false, -1>(mma_dkv, tdVrP(_, _, _, buf), tdVrdO(_, _, _, stage), acc_dv);
      wgmma<false, -1>(mma_dkv, tdKrdS(_, _, _, buf), tdKrQ(_, _, _, stage), acc_dk);
      wgmma<true, -1>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, acc_dq);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_dq);
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dk);
      pipeline_q.consumer_release(read);
      pipeline_do.consumer_release(read);
      ++read;

      // Each value has one adding thread per CTA and step, so a split that one
      // CTA owns (deterministic mode) sums in a fixed order.
      float* dq_tile = dq_split + stat_offset(p, tile, step.head_q, step.m_block) * kHeadDim +
                       (warpgroup == 0 ? Traits::template DqSlice<0>::kOffset : Traits::template DqSlice<1>::kOffset);
      CUTE_UNROLL
      for (int j = 0; j < size(acc_dq); j += 4) {
        atomicAdd(reinterpret_cast<float4*>(dq_tile + Traits::dq_index(j, wg_thread)),
                  make_float4(acc_dq(j), acc_dq(j + 1), acc_dq(j + 2), acc_dq(j + 3)));
      }
    }
  }
};

}  // namespace sm90
}  // namespace tfb
