// Persistent tile scheduler: one CTA per SM walks work units with a stride of
// the grid size; a unit is one or two query tiles of one (batch, head).
//
// Units of one (batch, head) are consecutive, so the CTAs running at the same
// time read the same K/V tiles, which mostly hit L2. Without a mask a unit is
// one query tile and every unit costs the same. Under a causal mask query
// tile m sees about m + 1 key tiles, so a unit folds tile M-1-i with tile i:
// every unit then costs about M + 1 key tiles, and striding equal units over
// the grid leaves the CTAs with equal loads (an odd M's middle tile is a unit
// of its own, at half the cost).
//
// A position encodes (unit, half): half 0 is the unit's first (heavier) tile,
// half 1 its folded partner.
#pragma once

#include <cute/config.hpp>

namespace tfb {
namespace sm90 {

struct TileScheduler {
  struct Tile {
    int m_block, head, batch;
  };

  int num_m_blocks;
  int heads;
  int batch;
  bool fold;  // causal: pair tile M-1-i with tile i

  CUTE_HOST_DEVICE int units_per_head() const { return fold ? (num_m_blocks + 1) / 2 : num_m_blocks; }
  CUTE_HOST_DEVICE int num_units() const { return units_per_head() * heads * batch; }

  CUTE_DEVICE int first() const { return 2 * int(blockIdx.x); }
  CUTE_DEVICE bool valid(int pos) const { return pos / 2 < num_units(); }
  CUTE_DEVICE int next(int pos) const {
    const int unit = pos / 2;
    const bool has_partner = fold && 2 * (unit % units_per_head()) + 1 < num_m_blocks;
    return pos % 2 == 0 && has_partner ? pos + 1 : 2 * (unit + int(gridDim.x));
  }

  CUTE_HOST_DEVICE Tile tile(int pos) const {
    const int unit = pos / 2;
    const int pair = unit / units_per_head();
    const int i = unit % units_per_head();
    return {pos % 2 == 0 ? num_m_blocks - 1 - i : i, pair % heads, pair / heads};
  }
};

}  // namespace sm90
}  // namespace tfb
