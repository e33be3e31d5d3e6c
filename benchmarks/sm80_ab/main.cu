// Times the sm80 forward of the working tree ("head") against a base commit's
// (build.sh compiles the base into namespace tfb::sm80_base), bf16, head dims 64
// and 128, the benchmark grid's shapes ((B, L, H, E) memory, B = 16384 / L,
// H = 2048 / E). The two take turns, one call each per round, 30 rounds; medians.
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>
#include "params.h"
#include "sm80/launch.h"
#include "harness_inputs.cuh"
namespace tfb::sm80_base {
template <typename Element, int kHeadDim>
cudaError_t launch_fwd(const AttnFwdParams& params, cudaStream_t stream);
}  // namespace tfb::sm80_base
static float elapsed_ms(cudaError_t (*fn)(const tfb::AttnFwdParams&, cudaStream_t), const tfb::AttnFwdParams& p) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a)); CK(fn(p, 0)); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
  float ms; CK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a); cudaEventDestroy(b);
  return ms;
}

template <int E>
void compare() {
  for (int causal = 0; causal < 2; ++causal) {
    for (int L : {1024, 4096, 16384}) {
      const int H = 2048 / E, B = 16384 / L;
      bf* o; tfb::AttnFwdParams p = make(B, H, L, E, causal, &o);
      auto head = &tfb::sm80::launch_fwd<bf, E>;
      auto base = &tfb::sm80_base::launch_fwd<bf, E>;
      for (int i = 0; i < 3; ++i) { CK(head(p, 0)); CK(base(p, 0)); }
      std::vector<float> th, tb;
      for (int i = 0; i < 30; ++i) { th.push_back(elapsed_ms(head, p)); tb.push_back(elapsed_ms(base, p)); }
      std::sort(th.begin(), th.end()); std::sort(tb.begin(), tb.end());
      const double flops = 4.0 * B * H * double(L) * L * E / (causal ? 2 : 1);
      printf("| %d | %d | %d | %.0f | %.0f | %.3f |\n", E, causal, L, flops / tb[15] / 1e9, flops / th[15] / 1e9,
             tb[15] / th[15]);
      cudaFree((void*)p.q); cudaFree((void*)p.k); cudaFree((void*)p.v); cudaFree(o); cudaFree(p.lse);
    }
  }
}

int main() {
  printf("| E | causal | L | base TFLOP/s | head TFLOP/s | head/base |\n|---|---|---|---|---|---|\n");
  compare<64>();
  compare<128>();
}
