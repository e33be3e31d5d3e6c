// The backward's steps and their shared pieces: which query tiles a key
// tile visits (BwdSteps, and the consumers' ConsumerSteps), the consumers'
// named barrier, and the bulk reduction that adds a step's dQ into the
// float32 accumulator.
#pragma once

#include <cute/tensor.hpp>

namespace tfb {
namespace sm90 {

enum class BwdBarrier : int {
  kConsumers = 1,  // every consumer thread: dS written / dQ staged
};

// The steps of one key tile: the query tiles that see its keys, for each
// query head of the GQA group in turn (dK and dV sum over the group in a
// fixed order).
struct BwdSteps {
  int m_begin, m_count, head_q0, count;
  struct Step {
    int head_q, m_block;
  };
  template <class Walk>
  CUTE_DEVICE BwdSteps(Walk const& walk, int n_block, int head_kv, int group) {
    const auto m = walk.m_blocks(n_block);
    m_begin = m.begin;
    m_count = m.end - m.begin;
    head_q0 = head_kv * group;
    count = group * m_count;
  }
  CUTE_DEVICE Step at(int i) const { return {head_q0 + i / m_count, m_begin + i % m_count}; }
};

// One 1D bulk reduction: global[0, bytes) += shared[0, bytes), float32.
CUTE_DEVICE void bulk_reduce_add(float* gmem, float const* smem, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
               "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
               : "memory");
}

// What a consumer computes at a step: query tile m_block of query head
// head_q, and whether its tile holds a hidden pair.
struct ConsumerStep {
  int m_block, head_q;
  bool predicate;
};

// The consumers' steps. Without a mask in memory they count them as the
// producer does. With one, only the producer walks the tile kinds: it
// writes each stage's step (StepNote) into shared memory before that
// stage's Q arrival (a release; the consumers' wait acquires it) and ends
// the key tile with a stage that loads nothing. Each consumer walking the
// kinds itself held a cursor and a mask view through each step (~22
// instructions a step and warp, benchmarks/history/2026-11-v9-v27.md, v24 and v27).
template <bool kNotes_, class Masks>
struct ConsumerSteps {
  static constexpr bool kNotes = kNotes_;
  BwdSteps const& steps;
  Masks const& masks;
  int batch, n_block;
  int i = 0;
  int head = 0, m = 0;  // step i's query head and tile from the first, in BwdSteps::at's order: counted, not divided

  // The next step into `step`, its Q stage waited for where notes are read;
  // false at the key tile's end (its empty stage consumed).
  template <class SharedStorage, class Pipeline, class PipelineState>
  CUTE_DEVICE bool take(SharedStorage& shared, Pipeline& pipeline_q, Pipeline& pipeline_do, PipelineState& read,
                        ConsumerStep& step) {
    if constexpr (kNotes) {
      pipeline_q.consumer_wait(read);
      const auto note = shared.notes[read.index()];  // kernel_traits_bwd.h StepNote
      if (note.m_block < 0) {
        pipeline_do.consumer_wait(read);
        pipeline_q.consumer_release(read);
        pipeline_do.consumer_release(read);
        ++read;
        return false;
      }
      step = {note.m_block, note.head_q, note.predicate != 0};
    } else {
      if (i >= steps.count) return false;
      ++i;
      const int head_q = steps.head_q0 + head, m_block = steps.m_begin + m;
      if (++m == steps.m_count) {
        m = 0;
        ++head;
      }
      step = {m_block, head_q, masks.mask(batch, head_q).needs_predicate(m_block, n_block)};
    }
    return true;
  }
};

}  // namespace sm90
}  // namespace tfb
