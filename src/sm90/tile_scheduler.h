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
//
// A packed batch's tiles come from a list (common/tile_list.h) that a pre-pass
// writes; PackedTileScheduler takes them dynamically, one tile per unit.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/tile_list.h"
#include "params.h"

namespace tfb {
namespace sm90 {

// One query tile of one (batch, head), in tensors of (row, dim, head, batch).
struct WorkTile {
  int m_block, head, batch;
  // The (row, dim) plane of head h of this tile's batch, in q's rows or k's.
  template <class Tensor>
  CUTE_DEVICE auto q_rows(Tensor const& t, int h) const { return t(cute::_, cute::_, h, batch); }
  template <class Tensor>
  CUTE_DEVICE auto k_rows(Tensor const& t, int h) const { return t(cute::_, cute::_, h, batch); }
};

// One query tile of one sequence of a packed batch, whose tensors are
// (total rows, dim, head, 1): the sequence starts q_row0 (k_row0) rows in.
// The backward's CTA holds one for its sequence's rows (m_block unused).
struct PackedTile {
  int m_block, head, batch;
  int q_row0, len_q, k_row0, len_k;
  template <class Tensor>
  CUTE_DEVICE auto q_rows(Tensor const& t, int h) const {
    return cute::domain_offset(cute::make_coord(q_row0, cute::_0{}), t(cute::_, cute::_, h, cute::_0{}));
  }
  template <class Tensor>
  CUTE_DEVICE auto k_rows(Tensor const& t, int h) const {
    return cute::domain_offset(cute::make_coord(k_row0, cute::_0{}), t(cute::_, cute::_, h, cute::_0{}));
  }
};

template <class Tile>
constexpr bool kPackedTile = std::is_same_v<Tile, PackedTile>;

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

// A packed batch's tiles, one per unit, taken dynamically from the list
// (whose count and counter the pre-pass wrote), with the sequence's offsets
// and lengths read once here, by the producer, for every role.
struct PackedTileScheduler {
  static constexpr bool kDynamic = true;
  using Tile = PackedTile;

  const TileEntry* entries;
  const int* count;
  int* next_unit;
  SeqLens seqlens;
  int len_q, len_k;  // the longest the caller named

  CUTE_DEVICE int first() const { return 2 * int(blockIdx.x); }
  CUTE_DEVICE bool valid(int pos) const { return pos / 2 < *count; }
  CUTE_DEVICE int next(int) const { return 2 * (int(gridDim.x) + atomicAdd(next_unit, 1)); }
  CUTE_DEVICE Tile tile(int pos) const {
    const TileEntry e = entries[pos / 2];
    return {e.block, e.head, e.batch, int(seqlens.q_begin(e.batch)), seqlens.q(e.batch, len_q),
            int(seqlens.k_begin(e.batch)), seqlens.k(e.batch, len_k)};
  }
};

// A dynamic scheduler's units, from the producer to the consumers: one
// phase of `ready` per unit, then one for the end (an invalid position). Unit
// i's position goes into slot i mod 2, published once the consumers have
// freed unit i - 1's Q, which they do after reading its position; the slot's
// previous readers (unit i - 2) have by then released K stages the producer
// waited for. With one slot, compute-sanitizer's racecheck reported the end's
// write against the last unit's reads (benchmarks/history/2026-11-v9-v27.md, v25).
// The unit goes with its tile, which the consumers would otherwise decode
// again (a packed tile costs global loads).
template <class Tile>
struct Unit {
  int pos;
  Tile tile;
};

struct UnitHandoff {
  static constexpr int kWords = 8;
  cutlass::arch::ClusterBarrier ready;
  int words[2][kWords];

  CUTE_DEVICE void init() { ready.init(1); }
  // count: how many units this CTA has run before.
  template <class Tile>
  CUTE_DEVICE void publish(Unit<Tile> const& unit, int count) {
    static_assert(sizeof(unit) <= sizeof(words[0]) && std::is_trivially_copyable_v<Unit<Tile>>);
    const int* from = reinterpret_cast<const int*>(&unit);
    CUTE_UNROLL
    for (int i = 0; i < int(sizeof(unit) / 4); ++i) words[count & 1][i] = from[i];
    asm volatile("" ::: "memory");  // the stores before the arrive (which releases them)
    ready.arrive();
  }
  template <class Tile>
  CUTE_DEVICE Unit<Tile> take(int count) {
    ready.wait(count & 1);
    asm volatile("" ::: "memory");  // the loads after the wait (which acquires them)
    Unit<Tile> unit;
    int* to = reinterpret_cast<int*>(&unit);
    CUTE_UNROLL
    for (int i = 0; i < int(sizeof(unit) / 4); ++i) to[i] = static_cast<volatile int*>(words[count & 1])[i];
    return unit;
  }
};

}  // namespace sm90
}  // namespace tfb
