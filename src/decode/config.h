// The decode family's shape constants and the small structs its host and
// device code share.
#pragma once

namespace tfb::decode {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMinSplitKeys = 128;  // a split's keys at least: 32 per warp
constexpr int kLanesPerKey = 4;   // lanes that share one key's dot products
constexpr int kMaxRows = 16;      // the most rows a CTA serves (src/registry.py's max_rows; api_decode.cu checks)

// The query rows of one kv head: row r is query position r / group of q head
// head_kv * group + r % group.
struct Rows {
  int count, group;
  __host__ __device__ int position(int r) const { return r / group; }
  __host__ __device__ int head_q(int head_kv, int r) const { return head_kv * group + r % group; }
};

// Split s of the keys [0, keys): [s * chunk, min((s + 1) * chunk, keys)).
struct Splits {
  int count, chunk;
};

}  // namespace tfb::decode
