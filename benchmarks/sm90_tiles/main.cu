// Times sm90 forward tile variants (declared by build.sh) on the benchmark grid's
// shapes: bf16, B = 16384/L, H = 2048/E, (B, L, H, E) memory, median of 15
// CUDA-event timings. Head dims 64 and 128 are also checked against the sm80
// forward on the same inputs (outputs poisoned before the launch).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <random>
#include <algorithm>
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>
#include "params.h"
#include "sm80/launch.h"
#include "harness_inputs.cuh"
//DECLS
struct Variant { const char* name; int e; cudaError_t (*fn)(const tfb::AttnFwdParams&, cudaStream_t); };
static Variant variants[] = { //TABLE
};
template <typename F>
float time_ms(F f) {
  for (int i = 0; i < 3; ++i) CK(f());
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> ts;
  for (int i = 0; i < 15; ++i) { cudaEventRecord(a); f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms); }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // lines show up as they come, also through a pipe
  for (auto& var : variants) {
    if (argc > 1 && !strstr(var.name, argv[1])) continue;  // optional filter on the variant name
    for (int causal = 0; causal < 2; ++causal) {
      for (int L : {512, 1024, 2048, 4096, 8192, 16384}) {
        int E = var.e, H = 2048 / E, B = 16384 / L;
        bf* o; tfb::AttnFwdParams p = make(B, H, L, E, causal, &o);
        // correctness vs sm80 on this shape
        bf* o2; CK(cudaMalloc(&o2, size_t(B) * L * H * E * 2));
        tfb::AttnFwdParams p2 = p; p2.o = o2;
        CK(cudaMemset(o, 0xff, size_t(B) * L * H * E * 2));
        CK(var.fn(p, 0));
        if (E == 64) CK((tfb::sm80::launch_fwd<bf, 64>(p2, 0))); else if (E == 128) CK((tfb::sm80::launch_fwd<bf, 128>(p2, 0)));
        CK(cudaDeviceSynchronize());
        double maxd = 0; size_t nan = 0;
        if (E == 64 || E == 128) {
          size_t n = size_t(B) * L * H * E; std::vector<bf> h1(n), h2(n);
          CK(cudaMemcpy(h1.data(), o, n * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(h2.data(), o2, n * 2, cudaMemcpyDeviceToHost));
          for (size_t i = 0; i < n; ++i) { float x = float(h1[i]); if (!(x == x)) ++nan; else maxd = std::max(maxd, (double)std::fabs(x - float(h2[i]))); }
        }
        double flops = 4.0 * B * H * double(L) * L * E / (causal ? 2 : 1);
        float ms = time_ms([&] { return var.fn(p, 0); });
        if (E == 64 || E == 128) {
          printf("%-16s E%-3d causal=%d L=%-5d %6.1f TFLOP/s  vs sm80: max|diff| %.3g, NaN %zu\n", var.name, E, causal, L,
                 flops / ms / 1e9, maxd, nan);
        } else {
          printf("%-16s E%-3d causal=%d L=%-5d %6.1f TFLOP/s  (unchecked)\n", var.name, E, causal, L, flops / ms / 1e9);
        }
        cudaFree((void*)p.q); cudaFree((void*)p.k); cudaFree((void*)p.v); cudaFree(o); cudaFree(o2); cudaFree(p.lse);
      }
    }
  }
}
