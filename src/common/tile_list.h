// The work of a packed batch for a persistent kernel: one entry per (sequence,
// head, query tile) that holds rows, so a scheduler never visits a tile past a
// sequence's end (a grid over the longest sequence would visit ~60x more tiles
// than exist in a batch of one long document and many short ones). A one-CTA
// pre-pass writes the list on the device from the offsets, read through
// params.h's accessors as the kernels read them: the host never reads them.
//
// Order: sequence by sequence, each head's tiles together (the CTAs running at
// once share K/V in L2), the last query tile first (under a causal band it sees
// the most keys, so the heavier tiles start first).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "params.h"

namespace tfb {

struct alignas(16) TileEntry {
  int m_block, head, batch, unused;  // 16 bytes: one load
};

struct TileList {
  TileEntry* entries = nullptr;
  int64_t capacity = 0;        // entries room; offsets whose sequences overlap may ask more, cut at this
  int* count = nullptr;        // written: the entries listed
  int* next_unit = nullptr;    // zeroed: a dynamic scheduler's counter
};

// Entries a packed batch may need with query tiles of block_m rows: each
// sequence's partial tile at most one more than its share of total_q.
inline int64_t tile_list_capacity(const AttnFwdParams& p, int block_m) {
  return (p.seqlens.total_q / block_m + p.batch) * int64_t(p.heads_q);
}

// The list's bytes: entries, then the two counters.
inline size_t tile_list_bytes(const AttnFwdParams& p, int block_m) {
  return size_t(tile_list_capacity(p, block_m)) * sizeof(TileEntry) + 16;
}

// The list carved from `workspace` (tile_list_bytes of it).
inline TileList tile_list_at(void* workspace, const AttnFwdParams& p, int block_m) {
  TileList list;
  list.entries = static_cast<TileEntry*>(workspace);
  list.capacity = tile_list_capacity(p, block_m);
  list.count = reinterpret_cast<int*>(list.entries + list.capacity);
  list.next_unit = list.count + 1;
  return list;
}

cudaError_t build_tile_list(const AttnFwdParams& p, int block_m, const TileList& list, cudaStream_t stream);

}  // namespace tfb
