// The work of a packed batch for a persistent or flat-grid kernel: one entry
// per (sequence, head, tile) that holds rows, so a kernel never visits a tile
// past a sequence's end (a grid over the longest sequence would visit ~60x
// more tiles than exist in a batch of one long document and many short ones).
// A one-CTA pre-pass writes the list on the device from the offsets, read
// through params.h's accessors as the kernels read them: the host never reads
// them.
//
// Order: sequence by sequence, its heads in groups of about a wave's tiles
// (the CTAs running at once share the group's K/V in L2; a long sequence's
// heads go one at a time), each group tile by tile, the heaviest under a
// causal band first: the last query tile (the forward's, which sees the most
// keys), the first key tile (the backward's, which the most queries see). A
// group's last tiles are then its lightest, which keeps the kernel's tail
// short (each head's tiles together left the last head's heaviest tile
// starting near the end).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "params.h"

namespace tfb {

// Which tiles: of the queries per query head, or of the keys per kv head.
enum class TileAxis : uint8_t { kQueries = 0, kKeys = 1 };

struct alignas(16) TileEntry {
  int block, head, batch, unused;  // 16 bytes: one load
};

struct TileList {
  TileEntry* entries = nullptr;
  int64_t capacity = 0;        // entries room; offsets whose sequences overlap may ask more, cut at this
  int* count = nullptr;        // written: the entries listed
  int* next_unit = nullptr;    // zeroed: a dynamic scheduler's counter
};

// Entries a packed batch may need with tiles of `rows` rows: each sequence's
// partial tile at most one more than its share of the total.
inline int64_t tile_list_capacity(const AttnFwdParams& p, int rows, TileAxis axis) {
  return axis == TileAxis::kKeys ? (p.seqlens.total_k / rows + p.batch) * int64_t(p.heads_kv)
                                 : (p.seqlens.total_q / rows + p.batch) * int64_t(p.heads_q);
}

// The list's bytes: entries, then the two counters.
inline size_t tile_list_bytes(const AttnFwdParams& p, int rows, TileAxis axis) {
  return size_t(tile_list_capacity(p, rows, axis)) * sizeof(TileEntry) + 16;
}

// The list carved from `workspace` (16-byte aligned; tile_list_bytes of it).
inline TileList tile_list_at(void* workspace, const AttnFwdParams& p, int rows, TileAxis axis) {
  TileList list;
  list.entries = static_cast<TileEntry*>(workspace);
  list.capacity = tile_list_capacity(p, rows, axis);
  list.count = reinterpret_cast<int*>(list.entries + list.capacity);
  list.next_unit = list.count + 1;
  return list;
}

cudaError_t build_tile_list(const AttnFwdParams& p, int rows, TileAxis axis, const TileList& list,
                            cudaStream_t stream);

}  // namespace tfb
