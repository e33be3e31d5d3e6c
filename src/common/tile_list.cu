// common/tile_list.h: one CTA walks the sequences 1024 at a time: a block scan
// of their tile counts gives each sequence's first entry, then every thread
// writes entries, finding its sequence by a binary search of the scan.
#include "common/tile_list.h"

#include <cub/block/block_scan.cuh>

namespace tfb {
namespace {

constexpr int kListThreads = 1024;

__global__ void __launch_bounds__(kListThreads) build_tile_list_kernel(const AttnFwdParams p, int rows,
                                                                       TileAxis axis, const TileList list) {
  using Scan = cub::BlockScan<int, kListThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int first_tile[kListThreads + 1];  // per sequence of the chunk; the last: the chunk's tiles
  const bool keys = axis == TileAxis::kKeys;
  const int heads = keys ? p.heads_kv : p.heads_q;
  int64_t listed = 0;  // entries of the chunks before
  for (int b0 = 0; b0 < p.batch; b0 += kListThreads) {
    const int b = b0 + int(threadIdx.x);
    const int tiles = b < p.batch ? ((keys ? p.seqlen_k(b) : p.seqlen_q(b)) + rows - 1) / rows : 0;
    int first, chunk_tiles;
    Scan(scan_storage).ExclusiveSum(tiles, first, chunk_tiles);
    first_tile[threadIdx.x] = first;
    if (threadIdx.x == 0) first_tile[kListThreads] = chunk_tiles;
    __syncthreads();
    const int64_t entries = int64_t(chunk_tiles) * heads;
    for (int64_t e = threadIdx.x; e < entries && listed + e < list.capacity; e += kListThreads) {
      // The chunk's sequence t holds entries [first_tile[t], first_tile[t + 1]) * heads;
      // the last t whose first entry is at most e holds e (the sequences between are empty).
      int lo = 0, hi = kListThreads - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (int64_t(first_tile[mid]) * heads <= e) lo = mid; else hi = mid - 1;
      }
      const int n = first_tile[lo + 1] - first_tile[lo];
      const int64_t r = e - int64_t(first_tile[lo]) * heads;
      // Heads in groups of about a wave's tiles, each group's heaviest tiles first.
      const int group = max(1, min(heads, p.num_sms / n));
      const int g = int(r / (int64_t(group) * n)), within = int(r % (int64_t(group) * n));
      const int in_group = min(group, heads - g * group);
      const int i = within / in_group;
      list.entries[listed + e] = {keys ? i : n - 1 - i, g * group + within % in_group, b0 + lo, 0};
    }
    listed += entries;
    __syncthreads();  // the next chunk reuses the scan's storage
  }
  if (threadIdx.x == 0) {
    *list.count = int(listed < list.capacity ? listed : list.capacity);
    *list.next_unit = 0;
  }
}

}  // namespace

cudaError_t build_tile_list(const AttnFwdParams& p, int rows, TileAxis axis, const TileList& list,
                            cudaStream_t stream) {
  build_tile_list_kernel<<<1, kListThreads, 0, stream>>>(p, rows, axis, list);
  return cudaGetLastError();
}

}  // namespace tfb
