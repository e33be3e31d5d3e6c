// Persistent tile scheduler: one CTA per SM walks work units; a unit is one
// or two query tiles of one (batch, head).
//
// Units of one (batch, head) are consecutive, so the CTAs running at the same
// time read the same K/V tiles, which mostly hit L2. Without a mask a unit is
// one query tile and every unit costs the same. Under a causal mask query
// tile m sees about m + 1 key tiles, so a unit folds tile M-1-i with tile i:
// every unit then costs about M + 1 key tiles, and striding equal units over
// the grid leaves the CTAs with equal loads (an odd M's middle tile is a unit
// of its own, at half the cost).
//
// Under a mask in memory a unit costs the key tiles the mask keeps, which the
// device alone knows; striding such units over the grid left the busiest CTA
// of a sliding window 1.18x the mean load. There the scheduler is dynamic
// (kDynamic): after the grid's first units, each CTA's producer takes the
// next unit from a counter in global memory, as soon as it starts the
// previous one, and hands it to its consumers through shared memory
// (UnitHandoff).
//
// A position encodes (unit, half): half 0 is the unit's first (heavier) tile,
// half 1 its folded partner.
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

namespace tfb {
namespace sm90 {

// One query tile of one (batch, head).
struct WorkTile {
  int m_block, head, batch;
};

template <bool kDynamic_>
struct TileScheduler {
  static constexpr bool kDynamic = kDynamic_;
  using Tile = WorkTile;

  int num_m_blocks;
  int heads;
  int batch;
  bool fold;             // causal: pair tile M-1-i with tile i
  int* next_unit = nullptr;  // kDynamic: units taken past the grid's first; zero at launch

  CUTE_HOST_DEVICE int units_per_head() const { return fold ? (num_m_blocks + 1) / 2 : num_m_blocks; }
  CUTE_HOST_DEVICE int num_units() const { return units_per_head() * heads * batch; }

  CUTE_DEVICE int first() const { return 2 * int(blockIdx.x); }
  CUTE_DEVICE bool valid(int pos) const { return pos / 2 < num_units(); }
  // The position after pos; dynamic, the producer's alone to call (it takes a unit).
  CUTE_DEVICE int next(int pos) const {
    const int unit = pos / 2;
    const bool has_partner = fold && 2 * (unit % units_per_head()) + 1 < num_m_blocks;
    if (pos % 2 == 0 && has_partner) return pos + 1;
    if constexpr (kDynamic) {
      return 2 * (int(gridDim.x) + atomicAdd(next_unit, 1));
    } else {
      return 2 * (unit + int(gridDim.x));
    }
  }

  CUTE_HOST_DEVICE Tile tile(int pos) const {
    const int unit = pos / 2;
    const int pair = unit / units_per_head();
    const int i = unit % units_per_head();
    return {pos % 2 == 0 ? num_m_blocks - 1 - i : i, pair % heads, pair / heads};
  }
};

// A dynamic scheduler's positions, from the producer to the consumers: one
// phase of `ready` per unit, then one for the end (an invalid position). Unit
// i's position goes into slot i mod 2, published once the consumers have
// freed unit i - 1's Q, which they do after reading its position; the slot's
// previous readers (unit i - 2) have by then released K stages the producer
// waited for. With one slot, compute-sanitizer's racecheck reported the end's
// write against the last unit's reads (benchmarks/history/2026-11-v9-v27.md, v25).
struct UnitHandoff {
  cutlass::arch::ClusterBarrier ready;
  int pos[2];

  CUTE_DEVICE void init() { ready.init(1); }
  // count: how many units this CTA has run before.
  CUTE_DEVICE void publish(int p, int count) {
    pos[count & 1] = p;
    asm volatile("" ::: "memory");  // the store before the arrive (which releases it)
    ready.arrive();
  }
  CUTE_DEVICE int take(int count) {
    ready.wait(count & 1);
    asm volatile("" ::: "memory");  // the load after the wait (which acquires it)
    return *static_cast<volatile int*>(&pos[count & 1]);
  }
};

}  // namespace sm90
}  // namespace tfb
