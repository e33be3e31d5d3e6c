// The decode family's shape constants and the small structs its host and
// device code share.
#pragma once

#include <cstddef>

namespace tfb::decode {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTileKeys = 16;       // keys per warp tile (one k16 step of P V)
constexpr int kMinSplitKeys = 128;  // a split's keys at least: two tiles per warp
constexpr int kMaxQueryLen = 16;    // short queries only: longer ones are the tiled forwards' (the router's MIN_QUERY_LEN - 1)
constexpr int kTileRows = 16;       // query rows a CTA serves: one mma tile
constexpr int kMaxRows = 256;       // rows per kv head at most, a CTA per tile of 16 (src/registry.py's max_rows; api_decode.cu checks)

constexpr int kStages = 3;          // tiles in a warp's ring: two in flight while one is read

// The combine's CTA: four warps, each staging several splits at once (eight
// lost where many rows have few splits each: benchmarks/history/2026-11-29-decode-small-calls.md).
constexpr int kCombineThreads = 128;

// With attn_mask a CTA first lists the tiles of its split that one of its rows
// sees, in shared memory after the rings, and the warps take the listed tiles
// alone: a static cache's unused tail costs a read of its mask bytes, not of
// its keys. An entry is the tile's index in the split, its top bit set when
// the mask hides some of the tile or adds a value other than 0 to a score
// (those tiles read the mask per score).
constexpr int kMaxListedTiles = 2048;                    // a masked split's tiles at most
constexpr int kMaxMaskedSplitKeys = kMaxListedTiles * kTileKeys;
constexpr int kMaxSplits = 128;
constexpr unsigned kPartlyHidden = 0x8000;

// Shared memory of one CTA: Q (its 16 rows), then each warp's ring of K and V
// tiles. The eight rows an ldmatrix reads must start in different banks: rows
// of whole 128-byte lines (head dims 64, 128, 192, 256) are stored unpadded
// with their 16-byte chunks permuted (kernel_fwd.h, Smem), so that each line
// of K and V lands on one aligned line of shared memory and is fetched by one
// L2 request; other rows are padded by 16 bytes.
constexpr bool smem_swizzled(int head_dim) { return head_dim % 64 == 0; }
constexpr size_t smem_row_elems(int head_dim) { return size_t(head_dim) + (smem_swizzled(head_dim) ? 0 : 8); }
constexpr size_t smem_bytes(int head_dim) {
  return (kTileRows + size_t(kWarps) * kStages * 2 * kTileKeys) * smem_row_elems(head_dim) * 2;
}
// With a mask: the tile list (16-bit entries) and a count per warp after that.
constexpr size_t smem_bytes(int head_dim, bool masked) {
  return smem_bytes(head_dim) + (masked ? kMaxListedTiles * 2 + kWarps * 4 : 0);
}

// CTAs of the decode kernel an SM holds at once (shared memory bounds it).
inline int ctas_per_sm(int head_dim, bool masked) {
  constexpr size_t kSmemPerSm = 228 * 1024, kReservedPerCta = 1024;
  const size_t fit = kSmemPerSm / (smem_bytes(head_dim, masked) + kReservedPerCta);
  return fit < 1 ? 1 : (fit > 4 ? 4 : int(fit));
}

// The query rows of one kv head: row r is query position r / group of q head
// head_kv * group + r % group.
struct Rows {
  int count, group;
  __host__ __device__ int tiles() const { return (count + kTileRows - 1) / kTileRows; }
  __host__ __device__ int position(int r) const { return r / group; }
  __host__ __device__ int head_q(int head_kv, int r) const { return head_kv * group + r % group; }
};

// Split s of the keys [0, keys): [s * chunk, min((s + 1) * chunk, keys)).
struct Splits {
  int count, chunk;
};

}  // namespace tfb::decode
