// The mask walk (common/mask.h TileWalk) an sm90 kernel reads: for uniform
// lengths the band is built once on the host and read from the constant bank
// (built per tile from the lengths, it kept more registers live through the
// forward's mainloop: 2-3.5% at head dim 128), while a packed batch's forward
// builds each sequence's band per tile (kernel_fwd.h); a mask in memory
// differs per (batch, query head), so its walk is built per tile (forward) or
// step (backward) from MaskArgs, and both roles read its tile kinds through a
// KindCursor.
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
    walk = Walk{mask::band_of(a.mask, a.len_q, a.len_k)};
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

// The tile kinds of a mask in memory along a walk's steps, read kAhead steps
// at a time. A kind is a load: read one at a time, their latency stalled
// every step, hidden tiles included (a sliding window's backward ran 1.8x its
// band's share of time; its forward read ~95 hidden kinds per query tile one
// after another). kWarp: a warp's lanes load a kind each and ballot (every
// lane of the warp walks); else one thread loads 8 (16 at once spilled 900
// bytes in the backward at head dim 128).
// KindAt: step i in [0, count) -> its tile's mask::TileKind.
template <bool kWarp, class KindAt>
struct KindCursor {
  static constexpr int kAhead = kWarp ? 32 : 8;
  static constexpr uint32_t kWindow = kAhead == 32 ? ~0u : (1u << kAhead) - 1;
  KindAt kind_at;
  int count;
  int base = -kAhead;  // hidden and partial: steps [base, base + kAhead), bit i - base
  uint32_t hidden = 0, partial = 0;

  CUTE_DEVICE KindCursor(KindAt const& kind_at_, int count_) : kind_at(kind_at_), count(count_) {}

  CUTE_DEVICE uint8_t kind(int i) const { return uint8_t(kind_at(i < count ? i : count - 1)); }
  CUTE_DEVICE void load(int from) {
    base = from;
    constexpr uint8_t kHidden = uint8_t(mask::TileKind::kHidden), kVisible = uint8_t(mask::TileKind::kVisible);
    if constexpr (kWarp) {
      const uint8_t k = kind(from + int(threadIdx.x % 32));
      hidden = __ballot_sync(~0u, k == kHidden);
      partial = __ballot_sync(~0u, k != kVisible);
    } else {
      uint8_t kinds[kAhead];
      CUTE_UNROLL
      for (int j = 0; j < kAhead; ++j) kinds[j] = kind(from + j);  // every load issued before the first use
      hidden = partial = 0;
      CUTE_UNROLL
      for (int j = 0; j < kAhead; ++j) {
        hidden |= uint32_t(kinds[j] == kHidden) << j;
        partial |= uint32_t(kinds[j] != kVisible) << j;
      }
    }
  }
  // The first step at or after i whose tile is not hidden (count or more:
  // none); i never below an earlier call's.
  CUTE_DEVICE int next(int i) {
    while (i < count) {
      if (i >= base + kAhead) load(i);
      const uint32_t visited = (~hidden & kWindow) >> (i - base);
      if (visited != 0) return i + __ffs(visited) - 1;
      i = base + kAhead;
    }
    return i;
  }
  // Whether step i's tile holds a hidden pair; i the last next() gave, below count.
  CUTE_DEVICE bool partial_at(int i) const { return (partial >> (i - base)) & 1; }
};

}  // namespace sm90
}  // namespace tfb
