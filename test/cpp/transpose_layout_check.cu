// Checks the byte offsets src/sm90/transpose_v.h computes by hand (ByteTile)
// against the CuTe layouts of the FP8 forward's V ring and transposed ring
// (src/sm90/kernel_traits_fwd.h), every element of every FP8 tile shape. Host
// code; run by test/test_fp8.py.
#include <cstdio>

#include <cute/tensor.hpp>

#include "sm90/kernel_traits_fwd.h"
#include "sm90/transpose_v.h"

namespace {

int failures = 0;

template <int kHeadDim>
void check() {
  using Traits = typename tfb::sm90::FwdConfig<cutlass::float_e4m3_t, kHeadDim>::Traits;
  constexpr int kKeys = Traits::kBlockN;
  const typename Traits::SmemLayoutKV v{};
  const typename Traits::SmemLayoutVt vt{};
  for (int key = 0; key < kKeys; ++key) {
    for (int d = 0; d < kHeadDim; ++d) {
      const int want_v = int(v(key, d, 0)), got_v = tfb::sm90::ByteTile<kKeys, kHeadDim>::offset(key, d);
      const int want_vt = int(vt(d, key, 0)), got_vt = tfb::sm90::ByteTile<kHeadDim, kKeys>::offset(d, key);
      if ((want_v != got_v || want_vt != got_vt) && ++failures <= 10) {
        std::printf("FAIL head dim %d key %d dim %d: V %d vs %d, Vt %d vs %d\n", kHeadDim, key, d, got_v, want_v,
                    got_vt, want_vt);
      }
    }
  }
  // The rings' stages follow each other.
  if (int(v(0, 0, 1)) != kKeys * kHeadDim || int(vt(0, 0, 1)) != kKeys * kHeadDim) {
    ++failures;
    std::printf("FAIL head dim %d: stage strides %d, %d\n", kHeadDim, int(v(0, 0, 1)), int(vt(0, 0, 1)));
  }
}

}  // namespace

int main() {
  check<64>();
  check<128>();
  check<256>();
  std::printf(failures ? "%d failures\n" : "ok\n", failures);
  return failures ? 1 : 0;
}
