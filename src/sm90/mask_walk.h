// The mask walk (common/mask.h TileWalk) an sm90 kernel reads: the family
// serves uniform lengths alone, so the band of is_causal is built once on the
// host and read from the constant bank (built per tile from the lengths, it
// kept more registers live through the forward's mainloop: 2-3.5% at head dim
// 128); a mask in memory differs per (batch, query head), so its walk is
// built per tile (forward) or step (backward) from MaskArgs.
#pragma once

#include <cute/tensor.hpp>

#include "common/mask.h"
#include "common/mask_summary.h"
#include "params.h"

namespace tfb {
namespace sm90 {

// What the kernel params hold: the band, or the lengths alone of a mask in memory.
template <class Walk>
Walk uniform_walk(const AttnFwdParams& a) {
  Walk walk{};
  if constexpr (mask::kReadsMemory<typename Walk::Policy>) {
    walk.policy.len_q = a.len_q;
    walk.policy.len_k = a.len_k;
  } else {
    walk = Walk{mask::causal_if(a.is_causal, a.mask.bottom_right, a.len_q, a.len_k)};
  }
  return walk;
}

// Batch b, query head h's walk: the band itself (a reference into the
// params), or the mask in memory.
template <class Walk>
CUTE_DEVICE decltype(auto) walk_of(Walk const& uniform, MaskArgs const& args, int b, int h) {
  using Policy = typename Walk::Policy;
  if constexpr (mask::kReadsMemory<Policy>) {
    return Walk{mask::from_memory<Policy>(args, b, h, uniform.policy.len_q, uniform.policy.len_k)};
  } else {
    return (uniform);
  }
}

}  // namespace sm90
}  // namespace tfb
