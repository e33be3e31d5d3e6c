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
      const auto rows = walk.m_blocks(n);
      if (seen > 0 && !(m >= rows.begin && m < rows.end)) fail("m_blocks misses a tile with a visible pair", lq, lk, m, n);
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

template <int kBlockM, int kBlockN>
void check_shapes() {
  namespace mk = tfb::mask;
  const int lens[] = {1, 2, 7, 16, 17, 33, 64, 100, 129};
  for (int lq : lens) {
    for (int lk : lens) {
      check<kBlockM, kBlockN>(mk::no_mask(lq, lk), [](int, int) { return true; });
      check<kBlockM, kBlockN>(mk::causal_top_left(lq, lk), [](int i, int j) { return j <= i; });
      check<kBlockM, kBlockN>(mk::causal_bottom_right(lq, lk), [=](int i, int j) { return j <= i + lk - lq; });
      for (int left : {0, 1, 5, 40, mk::kUnbounded}) {
        for (int right : {0, 3, mk::kUnbounded}) {
          for (int diag : {0, lk - lq, -3, 9}) {
            const auto rule = [=](int i, int j) {
              return (left == mk::kUnbounded || j >= i + diag - left) &&
                     (right == mk::kUnbounded || j <= i + diag + right);
            };
            check<kBlockM, kBlockN>(mk::sliding_window(lq, lk, left, right, diag), rule);
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
