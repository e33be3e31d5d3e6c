// Checks every mask policy of src/common/mask.h against the definition it
// states, by brute force over small shapes: the tile walks (key tiles of a
// query tile, query tiles of a key tile, which tiles need the predicate) must
// cover exactly the visible pairs. Run by test/test_mask_policy.py.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/mask.h"

namespace {

int failures = 0;

void fail(const char* what, int lq, int lk, int m, int n) {
  if (++failures <= 20) std::printf("FAIL %s: len_q %d len_k %d tile (%d, %d)\n", what, lq, lk, m, n);
}

// kBlockM x kBlockN walks of one policy; `rule` is the definition of visibility.
template <int kBlockM, int kBlockN, class Policy, class Rule>
void check(Policy const& policy, Rule rule) {
  const tfb::mask::TileWalk<kBlockM, kBlockN, Policy> walk{policy};
  const int lq = policy.len_q, lk = policy.len_k;
  for (int i = 0; i < lq; ++i) {
    for (int j = 0; j < lk; ++j) {
      if (policy.visible(i, j) != rule(i, j)) fail("visible", lq, lk, i, j);
    }
  }
  for (int m = 0; m < walk.num_m_blocks(); ++m) {
    const auto range = walk.n_blocks(m);
    const auto steps = walk.steps(m);
    if (steps.first != range.begin || steps.end != range.end) fail("steps' range", lq, lk, m, 0);
    for (int n = 0; n < walk.num_n_blocks(); ++n) {
      int seen = 0, hidden = 0;
      for (int i = m * kBlockM; i < (m + 1) * kBlockM && i < lq; ++i) {
        for (int j = n * kBlockN; j < (n + 1) * kBlockN; ++j) {
          (j < lk && rule(i, j) ? seen : hidden) += 1;
        }
      }
      const bool in_range = n >= range.begin && n < range.end;
      if (seen > 0 && !in_range) fail("n_blocks misses a tile with a visible pair", lq, lk, m, n);
      if (in_range && seen > 0 && hidden > 0 && !walk.needs_predicate(m, n)) fail("needs_predicate", lq, lk, m, n);
      // The forward's per-tile form agrees with the per-step one.
      if (in_range && walk.needs_predicate(steps, m, n) != walk.needs_predicate(m, n)) {
        fail("needs_predicate from steps", lq, lk, m, n);
      }
      const auto rows = walk.m_blocks(n);
      if (seen > 0 && !(m >= rows.begin && m < rows.end)) fail("m_blocks misses a tile with a visible pair", lq, lk, m, n);
    }
    // The forward walks go down from the range's last tile with
    // visited_at_or_below, which ends below its first.
    for (int n = range.end - 1; n >= range.begin - 1; --n) {
      const bool inside = n >= range.begin && n >= 0;
      if (walk.visited_at_or_below(steps, m, n) != (inside ? n : -1)) fail("visited_at_or_below", lq, lk, m, n);
      if (walk.visited_at_or_below(m, n) != (inside ? n : -1)) fail("visited_at_or_below per step", lq, lk, m, n);
    }
    // The range is tight at its ends: its first and last tiles hold a visible pair.
    for (int n : {range.begin, range.end - 1}) {
      if (range.end <= range.begin) break;
      bool any = false;
      for (int i = m * kBlockM; i < (m + 1) * kBlockM && i < lq; ++i) {
        for (int j = n * kBlockN; j < (n + 1) * kBlockN && j < lk; ++j) any = any || rule(i, j);
      }
      if (!any) fail("n_blocks has an empty end tile", lq, lk, m, n);
    }
  }
}

// The band MaskArgs describe (params.h), through band_of, the one reading of it.
tfb::mask::Band band(int lq, int lk, tfb::MaskMode mode, int left = -1, int right = -1, bool bottom_right = false) {
  tfb::MaskArgs m;
  m.mode = mode;
  m.window_left = left;
  m.window_right = right;
  m.bottom_right = bottom_right;
  return tfb::mask::band_of(m, lq, lk);
}

template <int kBlockM, int kBlockN>
void check_shapes() {
  using tfb::MaskMode;
  const int lens[] = {1, 2, 7, 16, 17, 33, 64, 100, 129};
  for (int lq : lens) {
    for (int lk : lens) {
      check<kBlockM, kBlockN>(band(lq, lk, MaskMode::kNone), [](int, int) { return true; });
      // A mask in memory's mode leaves every key in range (its tiles say the rest).
      check<kBlockM, kBlockN>(band(lq, lk, MaskMode::kBool, 3, 0), [](int, int) { return true; });
      check<kBlockM, kBlockN>(band(lq, lk, MaskMode::kBand, -1, 0), [](int i, int j) { return j <= i; });
      check<kBlockM, kBlockN>(band(lq, lk, MaskMode::kBand, -1, 0, true), [=](int i, int j) { return j <= i + lk - lq; });
      for (int left : {0, 1, 5, 40, -1}) {
        for (int right : {0, 3, -1}) {
          for (bool bottom_right : {false, true}) {
            const int diag = bottom_right ? lk - lq : 0;
            const auto rule = [=](int i, int j) {
              return (left < 0 || j >= i + diag - left) && (right < 0 || j <= i + diag + right);
            };
            check<kBlockM, kBlockN>(band(lq, lk, MaskMode::kBand, left, right, bottom_right), rule);
          }
        }
      }
    }
  }
}

}  // namespace

int main() {
  check_shapes<16, 16>();
  check_shapes<16, 8>();
  check_shapes<8, 32>();
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("mask policies agree with their definitions\n");
  return 0;
}
