// Persistent tile scheduler: one CTA per SM walks the (query tile, head,
// batch) tiles with a stride of the grid size.
//
// Tiles are handed out heaviest first: under a causal mask a query tile's work
// grows with its index, so the last query tiles go out in the first wave and
// the short ones fill the gaps at the end (longest-processing-time order).
// Heads vary fastest, so CTAs running at the same time share K/V of a GQA
// group and of a batch in L2.
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

  CUTE_HOST_DEVICE int num_tiles() const { return num_m_blocks * heads * batch; }

  CUTE_HOST_DEVICE Tile tile(int index) const {
    const int per_m_block = heads * batch;
    const int m_block = num_m_blocks - 1 - index / per_m_block;
    const int rest = index % per_m_block;
    return {m_block, rest % heads, rest / heads};
  }
};

}  // namespace sm90
}  // namespace tfb
