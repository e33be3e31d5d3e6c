// The backward's steps and their shared pieces: which query tiles a key
// tile visits (BwdSteps), the consumers' named barrier, and the bulk
// reduction that adds a step's dQ into the float32 accumulator.
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

}  // namespace sm90
}  // namespace tfb
