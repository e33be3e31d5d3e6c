// FP8's V transpose: FP8 wgmma reads its B operand K-major, so P V wants V
// with the keys contiguous, while TMA lands V's tiles with the head dim
// contiguous. The producer warpgroup rewrites each landed tile into a second
// ring, 4 keys x 4 dims per thread step: four 32-bit loads, a byte
// transpose in registers (__byte_perm), four 32-bit stores.
//
// The keys go in the order P's registers hold them. An accumulator gives a
// thread, per row and 16 keys, columns {2t, 2t+1, 2t+8, 2t+9} (t its lane
// in the quad), and an 8-bit A operand wants 4 consecutive k from each lane:
// so P's registers are used as they are, and position 4t + i of each 16 keys
// of the transposed tile holds key key_of_position(i) + 2t (the sum over k
// does not care about its order).
//
// Lanes: 4 (t) x 8 (head-dim words); a store's row is rotated per lane pair
// so that the 32 stores of a warp fall in 32 banks under the 128- and
// 64-byte swizzles (unrotated, 8 lanes shared a bank).
#pragma once

#include <cute/tensor.hpp>

namespace tfb {
namespace sm90 {

using namespace cute;

// The key (of 16) at position 4t + i, less 2t: 0, 1, 8, 9.
CUTE_HOST_DEVICE constexpr int key_of_position(int i) { return (i & 1) + 8 * (i >> 1); }

// sV: (keys, head dim) as TMA landed it; sVt: (head dim, keys), the B
// operand's view; keys at or past `keys` are written as zeros (a packed
// tile's rows of the next sequence). kThreads threads, thread_idx among them.
template <int kThreads, class SrcTensor, class DstTensor>
CUTE_DEVICE void transpose_v_tile(SrcTensor const& sV, DstTensor& sVt, int keys, int thread_idx) {
  constexpr int kKeys = decltype(size<0>(sV))::value;
  constexpr int kDim = decltype(size<1>(sV))::value;
  static_assert(kKeys % 16 == 0 && kDim % 32 == 0 && kThreads % 32 == 0);
  constexpr int kWarps = kThreads / 32;
  // Steps of one warp: (16-key group, 32-dim group).
  constexpr int kSteps = (kKeys / 16) * (kDim / 32);
  static_assert(kSteps % kWarps == 0);
  const int lane = thread_idx % 32, warp = thread_idx / 32;
  const int t = lane % 4, word = lane / 4;
  // Rotation of this lane's four output rows (see above).
  const int rot = (word >> 1) & 3;
  CUTE_UNROLL
  for (int s = warp; s < kSteps; s += kWarps) {
    const int group = s % (kKeys / 16), dim = (s / (kKeys / 16)) * 32 + word * 4;
    uint32_t in[4];
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int key = group * 16 + 2 * t + key_of_position(i);
      in[i] = key < keys ? *reinterpret_cast<uint32_t const*>(&sV(key, dim)) : 0u;
      // Rotated by rot bytes: out[j] below is then dim + (j + rot) % 4.
      in[i] = __funnelshift_r(in[i], in[i], 8 * rot);
    }
    const uint32_t lo01 = __byte_perm(in[0], in[1], 0x5140), hi01 = __byte_perm(in[0], in[1], 0x7362);
    const uint32_t lo23 = __byte_perm(in[2], in[3], 0x5140), hi23 = __byte_perm(in[2], in[3], 0x7362);
    const uint32_t out[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                             __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      *reinterpret_cast<uint32_t*>(&sVt(dim + ((j + rot) & 3), group * 16 + 4 * t)) = out[j];
    }
  }
}

}  // namespace sm90
}  // namespace tfb
