// Checks the byte offsets src/sm90/transpose_v.h computes by hand (ByteTile)
// against the CuTe layouts of the FP8 forward's V ring and transposed ring
// (src/sm90/kernel_traits_fwd.h), every element of every FP8 tile shape; then
// replays transpose_v_tile lane by lane on the host (ldmatrix.trans, the byte
// permutes, stmatrix, as the PTX ISA defines them, with TransposeSteps'
// addresses) and checks that every transposed byte lands where the wgmma reads
// it, zeros past `keys`, that the rows of ones below the dims (kSumsInO) fill
// every stage without touching a transposed byte, and how many shared-memory
// bank conflicts each 8x8 matrix's rows have. Host code; run by test/test_fp8.py, which reads the
// last line ("ok" or the failures).
// The traits name wgmma widths such as 224 (registry.py's wide_mma).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <cute/tensor.hpp>

#include "sm90/kernel_traits_fwd.h"
#include "sm90/transpose_v.h"

namespace {

int failures = 0;

template <int kHeadDim>
void check() {
  using Traits = typename tfb::sm90::FwdConfig<cutlass::float_e4m3_t, kHeadDim>::Traits;
  constexpr int kKeys = Traits::kBlockN, kRows = Traits::kPVCols;
  const typename Traits::SmemLayoutKV v{};
  const typename Traits::SmemLayoutVt vt{};
  for (int key = 0; key < kKeys; ++key) {
    for (int d = 0; d < kRows; ++d) {
      const int want_v = d < kHeadDim ? int(v(key, d, 0)) : 0;
      const int got_v = d < kHeadDim ? tfb::sm90::ByteTile<kKeys, kHeadDim>::offset(key, d) : 0;
      const int want_vt = int(vt(d, key, 0)), got_vt = tfb::sm90::ByteTile<kRows, kKeys>::offset(d, key);
      if ((want_v != got_v || want_vt != got_vt) && ++failures <= 10) {
        std::printf("FAIL head dim %d key %d dim %d: V %d vs %d, Vt %d vs %d\n", kHeadDim, key, d, got_v, want_v,
                    got_vt, want_vt);
      }
    }
  }
  // The rings' stages follow each other.
  if (int(v(0, 0, 1)) != kKeys * kHeadDim || int(vt(0, 0, 1)) != kKeys * kRows) {
    ++failures;
    std::printf("FAIL head dim %d: stage strides %d, %d\n", kHeadDim, int(v(0, 0, 1)), int(vt(0, 0, 1)));
  }
}

// __byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of y:x.
uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t both = (uint64_t(y) << 32) | x;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) out |= uint32_t((both >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return out;
}

// Rows of one 8x8 matrix (a phase of ldmatrix / stmatrix) that share banks:
// each row is 16 bytes, so 8 rows in distinct 16-byte columns of a 128-byte
// line are conflict-free; returns the phase's extra wavefronts.
int conflicts(const int (&rows)[8]) {
  int per_column[8] = {};
  for (int r = 0; r < 8; ++r) ++per_column[(rows[r] % 128) / 16];
  int worst = 0;
  for (int c = 0; c < 8; ++c) worst = per_column[c] > worst ? per_column[c] : worst;
  return worst - 1;
}

template <int kHeadDim>
void replay(int keys, int& load_conflicts, int& store_conflicts) {
  using Traits = typename tfb::sm90::FwdConfig<cutlass::float_e4m3_t, kHeadDim>::Traits;
  constexpr int kKeys = Traits::kBlockN, kRows = Traits::kPVCols, kStages = Traits::kStages;
  using Steps = tfb::sm90::TransposeSteps<kKeys, kHeadDim, kRows>;
  std::vector<uint8_t> src(kKeys * kHeadDim), dst(kKeys * kRows * kStages, 0xee);
  // The rows below the dims in every stage, as the kernel fills them at start (by 7 threads here).
  for (int thread = 0; thread < 7; ++thread) {
    tfb::sm90::fill_rows_below<kKeys, kHeadDim, kRows>(dst.data(), kStages, 0x38, thread, 7);
  }
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i * 131 + 7 + (i >> 8));  // no two rows alike
  for (int warp = 0; warp < 4; ++warp) {
    for (int gi = 0; gi < Steps::kGroupsPerWarp; ++gi) {
      const int group = warp + 4 * gi;
      if (group >= Steps::kGroups) break;
      for (int b = 0; b < kHeadDim / 32; ++b) {
        int from[32], to[32];
        for (int lane = 0; lane < 32; ++lane) {
          from[lane] = Steps::load_row(Steps::load_lane(lane), group, b);
          to[lane] = Steps::store_row(Steps::store_lane(lane), group, b);
        }
        for (int m = 0; m < 4; ++m) {
          int ld[8], st[8];
          for (int r = 0; r < 8; ++r) ld[r] = from[8 * m + r], st[r] = to[8 * m + r];
          load_conflicts += conflicts(ld);
          store_conflicts += conflicts(st);
        }
        uint32_t w[32][4];
        for (int lane = 0; lane < 32; ++lane) {
          const int t = lane % 4, c = lane / 4;
          // ldmatrix .trans, 16-bit elements: lane 4c + t gets element c of
          // rows 2t and 2t + 1 of each matrix (rows addressed by lanes 8m + row).
          uint32_t v[4];
          for (int m = 0; m < 4; ++m) {
            const uint8_t* row0 = &src[from[8 * m + 2 * t]];
            const uint8_t* row1 = &src[from[8 * m + 2 * t + 1]];
            v[m] = uint32_t(row0[2 * c]) | uint32_t(row0[2 * c + 1]) << 8 | uint32_t(row1[2 * c]) << 16 |
                   uint32_t(row1[2 * c + 1]) << 24;
          }
          uint32_t keep = 0xffffffffu;
          if (keys < kKeys) {
            keep = 0;
            for (int i = 0; i < 4; ++i)
              keep |= (group * 16 + 2 * t + tfb::sm90::key_of_position(i) < keys ? 0xffu : 0u) << (8 * i);
          }
          const uint32_t even = Steps::selector(lane, true), odd = Steps::selector(lane, false);
          w[lane][0] = byte_perm(v[0], v[1], even) & keep;
          w[lane][1] = byte_perm(v[0], v[1], odd) & keep;
          w[lane][2] = byte_perm(v[2], v[3], even) & keep;
          w[lane][3] = byte_perm(v[2], v[3], odd) & keep;
        }
        // stmatrix, 16-bit elements: row r of matrix m (address of lane 8m + r)
        // gets elements 2t, 2t + 1 from lane 4r + t's register m.
        for (int m = 0; m < 4; ++m) {
          for (int r = 0; r < 8; ++r) {
            for (int t = 0; t < 4; ++t) std::memcpy(&dst[to[8 * m + r] + 4 * t], &w[4 * r + t][m], 4);
          }
        }
      }
    }
  }
  // Position 4t + i of each 16 keys holds key key_of_position(i) + 2t.
  // Stage 0 holds the transpose; later stages' dims are untouched (0xee).
  using Src = tfb::sm90::ByteTile<kKeys, kHeadDim>;
  using Dst = tfb::sm90::ByteTile<kRows, kKeys>;
  for (int stage = 0; stage < kStages; ++stage) {
    for (int d = 0; d < kRows; ++d) {
      for (int pos = 0; pos < kKeys; ++pos) {
        const int key = pos / 16 * 16 + 2 * (pos % 16 / 4) + tfb::sm90::key_of_position(pos % 4);
        const uint8_t want = d >= kHeadDim ? 0x38 : stage > 0 ? 0xee : key < keys ? src[Src::offset(key, d)] : 0;
        const uint8_t got = dst[stage * kKeys * kRows + Dst::offset(d, pos)];
        if (want != got && ++failures <= 10) {
          std::printf("FAIL replay head dim %d keys %d: stage %d dim %d position %d holds %d, not %d\n", kHeadDim,
                      keys, stage, d, pos, got, want);
        }
      }
    }
  }
}

template <int kHeadDim>
void replay_all() {
  constexpr int kKeys = tfb::sm90::FwdConfig<cutlass::float_e4m3_t, kHeadDim>::Traits::kBlockN;
  int load_conflicts = 0, store_conflicts = 0;
  replay<kHeadDim>(kKeys, load_conflicts, store_conflicts);
  int unused = 0;
  replay<kHeadDim>(kKeys - 37, unused, unused);  // a packed tile's last keys: zeros
  std::printf("head dim %d: %d load and %d store bank conflicts in %d matrices of each\n", kHeadDim, load_conflicts,
              store_conflicts, 4 * (kKeys / 16) * (kHeadDim / 32));
  failures += load_conflicts + store_conflicts;  // every 8x8 matrix's rows in eight different 16-byte columns
}

}  // namespace

int main() {
  check<64>();
  check<128>();
  check<256>();
  replay_all<64>();
  replay_all<128>();
  replay_all<256>();
  std::printf(failures ? "%d failures\n" : "ok\n", failures);
  return failures ? 1 : 0;
}
