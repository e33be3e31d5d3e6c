// Persistent tile scheduler: one CTA per SM walks the (query tile, head,
// batch) tiles with a stride of the grid size.
//
// The (batch, head) pairs are cut into sections of consecutive tiles; within
// a section the query tiles go out last first, across its pairs. Without a
// mask a section is one pair: the CTAs running at the same time then read the
// same K/V tiles, which mostly hit L2. Under a causal mask a query tile's work
// grows with its index and a section is every pair: all heavy tiles go out
// first and the short ones fill the gaps at the end (longest-processing-time
// order); per-pair sections left the grid-strided CTAs with unequal loads.
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
  int section;  // (batch, head) pairs per section

  CUTE_HOST_DEVICE int num_tiles() const { return num_m_blocks * heads * batch; }

  CUTE_HOST_DEVICE Tile tile(int index) const {
    const int first_pair = index / (section * num_m_blocks) * section;
    const int pairs = min(section, heads * batch - first_pair);
    const int rest = index - first_pair * num_m_blocks;
    const int pair = first_pair + rest % pairs;
    return {num_m_blocks - 1 - rest / pairs, pair % heads, pair / heads};
  }
};

}  // namespace sm90
}  // namespace tfb
