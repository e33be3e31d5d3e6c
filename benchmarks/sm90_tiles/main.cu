// Times sm90 forward variants (declared by build.sh) on the benchmark grid's
// shapes: bf16, B = 16384/L, H = 2048/E, (B, L, H, E) memory. The variants of
// one head dim share inputs and are timed in turns (one call of each per
// round, median of 15 rounds), so all see the same card states. Head dims 64
// and 128 are checked against the sm80 forward on the same inputs; every
// variant against the first one of its head dim (outputs poisoned before each
// launch). With SUSTAIN_S=<seconds>, each variant then also runs the 16K shapes
// back to back for that long (twice, in turns), reporting the rate over the
// second half: the rate at the card's power cap, which short timings miss.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
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

static std::vector<bf> run_once(cudaError_t (*fn)(const tfb::AttnFwdParams&, cudaStream_t), const tfb::AttnFwdParams& p,
                                size_t n) {
  CK(cudaMemset(p.o, 0xff, n * 2));
  CK(fn(p, 0));
  CK(cudaDeviceSynchronize());
  std::vector<bf> h(n);
  CK(cudaMemcpy(h.data(), p.o, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

static void diff(const std::vector<bf>& a, const std::vector<bf>& b, double* maxd, size_t* nan) {
  *maxd = 0; *nan = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const float x = float(a[i]);
    if (!(x == x)) ++*nan; else *maxd = std::max(*maxd, (double)std::fabs(x - float(b[i])));
  }
}

// TFLOP/s over the second half of `seconds` of back-to-back calls.
static double sustained(cudaError_t (*fn)(const tfb::AttnFwdParams&, cudaStream_t), const tfb::AttnFwdParams& p,
                        double flops, double seconds) {
  double rate = 0;
  for (int half = 0; half < 2; ++half) {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    cudaEventRecord(a);
    long calls = 0; float ms = 0;
    while (ms < seconds * 500) {
      for (int i = 0; i < 8; ++i) fn(p, 0);
      calls += 8;
      cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b);
    }
    rate = flops * calls / ms / 1e9;
    cudaEventDestroy(a); cudaEventDestroy(b);
  }
  CK(cudaGetLastError());
  return rate;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // lines show up as they come, also through a pipe
  std::vector<Variant> chosen;
  for (auto& var : variants) {
    if (argc > 1 && !strstr(var.name, argv[1])) continue;  // optional filter on the variant name
    chosen.push_back(var);
  }
  std::vector<int> dims;
  for (auto& v : chosen) if (std::find(dims.begin(), dims.end(), v.e) == dims.end()) dims.push_back(v.e);
  for (int E : dims) {
    std::vector<Variant> group;
    for (auto& v : chosen) if (v.e == E) group.push_back(v);
    for (int causal = 0; causal < 2; ++causal) {
      for (int L : {512, 1024, 2048, 4096, 8192, 16384}) {
        const int H = 2048 / E, B = 16384 / L;
        const size_t n = size_t(B) * L * H * E;
        bf* o; tfb::AttnFwdParams p = make(B, H, L, E, causal, &o);
        std::vector<bf> ref;
        if (E == 64) ref = run_once(&tfb::sm80::launch_fwd<bf, 64>, p, n);
        if (E == 128) ref = run_once(&tfb::sm80::launch_fwd<bf, 128>, p, n);
        std::vector<double> maxd(group.size()); std::vector<size_t> nan(group.size());
        std::vector<bf> first;
        for (size_t i = 0; i < group.size(); ++i) {
          std::vector<bf> out = run_once(group[i].fn, p, n);
          if (i == 0) first = out;
          diff(out, ref.empty() ? first : ref, &maxd[i], &nan[i]);
        }
        for (int w = 0; w < 3; ++w) for (auto& v : group) CK(v.fn(p, 0));
        std::vector<std::vector<float>> ts(group.size());
        cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
        for (int round = 0; round < 15; ++round) {
          for (size_t i = 0; i < group.size(); ++i) {
            cudaEventRecord(a); group[i].fn(p, 0); cudaEventRecord(b); cudaEventSynchronize(b);
            float ms; cudaEventElapsedTime(&ms, a, b); ts[i].push_back(ms);
          }
        }
        CK(cudaGetLastError());
        cudaEventDestroy(a); cudaEventDestroy(b);
        const double flops = 4.0 * B * H * double(L) * L * E / (causal ? 2 : 1);
        for (size_t i = 0; i < group.size(); ++i) {
          std::sort(ts[i].begin(), ts[i].end());
          const float ms = ts[i][ts[i].size() / 2];
          printf("%-22s E%-3d causal=%d L=%-5d %6.1f TFLOP/s  vs %s: max|diff| %.3g, NaN %zu\n", group[i].name, E, causal,
                 L, flops / ms / 1e9, ref.empty() ? group[0].name : "sm80", maxd[i], nan[i]);
        }
        if (L == 16384 && getenv("SUSTAIN_S")) {
          const double seconds = atof(getenv("SUSTAIN_S"));
          for (int pass = 0; pass < 2; ++pass)
            for (auto& v : group)
              printf("%-22s E%-3d causal=%d L=%-5d %6.1f TFLOP/s sustained %.0f s (pass %d)\n", v.name, E, causal, L,
                     sustained(v.fn, p, flops, seconds), seconds, pass);
        }
        cudaFree((void*)p.q); cudaFree((void*)p.k); cudaFree((void*)p.v); cudaFree(o); cudaFree(p.lse);
      }
    }
  }
}
