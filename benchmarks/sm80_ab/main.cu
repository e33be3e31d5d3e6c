// Times the sm80 forward (bf16, head dims 64 and 128) and backward (head dim
// 128) of the working tree ("head") against a base commit's (build.sh compiles
// the base with -Dtfb=tfb_base), on the benchmark grid's shapes: (B, L, H, E)
// memory, B = 16384 / L, H = 2048 / E. The two take turns, one call each per
// round, 30 rounds; medians. Before timing, both sides' outputs on the same
// inputs are compared (poisoned before each launch).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "harness_inputs.cuh"

#define TFB_AB_SIDE(ns)                                                                        \
  namespace ns::ab {                                                                           \
  struct Buffers {                                                                             \
    void *q, *k, *v, *o, *dout, *dq, *dk, *dv, *workspace;                                    \
    float* lse;                                                                                \
  };                                                                                           \
  cudaError_t fwd(const Buffers& b, int B, int H, int L, int E, bool causal);                 \
  size_t bwd_workspace_bytes(int B, int H, int L, int E, bool causal);                        \
  cudaError_t bwd(const Buffers& b, int B, int H, int L, int E, bool causal);                 \
  }
TFB_AB_SIDE(tfb)
TFB_AB_SIDE(tfb_base)

struct Shape { int B, H, L, E; bool causal; };

static tfb::ab::Buffers head_bufs;
static tfb_base::ab::Buffers base_bufs;

static cudaError_t head_fwd(const Shape& s) { return tfb::ab::fwd(head_bufs, s.B, s.H, s.L, s.E, s.causal); }
static cudaError_t base_fwd(const Shape& s) { return tfb_base::ab::fwd(base_bufs, s.B, s.H, s.L, s.E, s.causal); }
static cudaError_t head_bwd(const Shape& s) { return tfb::ab::bwd(head_bufs, s.B, s.H, s.L, s.E, s.causal); }
static cudaError_t base_bwd(const Shape& s) { return tfb_base::ab::bwd(base_bufs, s.B, s.H, s.L, s.E, s.causal); }

static float elapsed_ms(cudaError_t (*fn)(const Shape&), const Shape& s) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a)); CK(fn(s)); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
  float ms; CK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a); cudaEventDestroy(b);
  return ms;
}

static std::vector<bf> fetch(const void* p, size_t n) {
  std::vector<bf> h(n);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

static double max_diff(const std::vector<bf>& a, const std::vector<bf>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = float(a[i]), y = float(b[i]);
    if (!(x == x) || !(y == y)) return INFINITY;
    d = std::max(d, std::fabs(x - y));
  }
  return d;
}

// Runs both sides once on the same inputs; the largest difference of the outputs.
static double check(bool backward, const Shape& s, size_t n) {
  void* outs[] = {head_bufs.o, head_bufs.dq, head_bufs.dk, head_bufs.dv};
  std::vector<std::vector<bf>> got[2];
  for (int side = 0; side < 2; ++side) {
    for (void* o : outs) CK(cudaMemset(o, 0xff, n * 2));
    CK(side == 0 ? head_fwd(s) : base_fwd(s));
    if (backward) CK(side == 0 ? head_bwd(s) : base_bwd(s));
    for (int i = 0; i < (backward ? 4 : 1); ++i) got[side].push_back(fetch(outs[i], n));
  }
  double d = 0;
  for (size_t i = 0; i < got[0].size(); ++i) d = std::max(d, max_diff(got[0][i], got[1][i]));
  return d;
}

static void compare(bool backward, int E) {
  for (int causal = 0; causal < 2; ++causal) {
    for (int L : {1024, 4096, 16384}) {
      const Shape s{16384 / L, 2048 / E, L, E, causal != 0};
      const size_t n = size_t(s.B) * L * s.H * E;
      bf* o;
      const tfb::AttnFwdParams in = make(s.B, s.H, L, E, s.causal, &o);  // q, k, v filled
      bf *dout, *dq, *dk, *dv;
      CK(cudaMalloc(&dout, n * 2)); CK(cudaMalloc(&dq, n * 2)); CK(cudaMalloc(&dk, n * 2)); CK(cudaMalloc(&dv, n * 2));
      fill<<<1024, 256>>>(dout, n, 7 * (E + L));
      const size_t ws = backward ? std::max(tfb::ab::bwd_workspace_bytes(s.B, s.H, L, E, s.causal),
                                            tfb_base::ab::bwd_workspace_bytes(s.B, s.H, L, E, s.causal)) : 0;
      void* workspace = nullptr;
      if (ws) CK(cudaMalloc(&workspace, ws));
      // Both sides share the buffers: the base reads the head's forward output too.
      head_bufs = {const_cast<void*>(in.q), const_cast<void*>(in.k), const_cast<void*>(in.v), o, dout, dq, dk, dv,
                   workspace, in.lse};
      base_bufs = {head_bufs.q, head_bufs.k, head_bufs.v, o, dout, dq, dk, dv, workspace, in.lse};
      const double diff = check(backward, s, n);
      auto head = backward ? head_bwd : head_fwd;
      auto base = backward ? base_bwd : base_fwd;
      if (backward) CK(head_fwd(s));  // o and lse for the backward
      for (int i = 0; i < 3; ++i) { CK(head(s)); CK(base(s)); }
      std::vector<float> th, tb;
      for (int i = 0; i < 30; ++i) { th.push_back(elapsed_ms(head, s)); tb.push_back(elapsed_ms(base, s)); }
      std::sort(th.begin(), th.end()); std::sort(tb.begin(), tb.end());
      // The backward's five GEMMs against the forward's two.
      const double flops = (backward ? 2.5 : 1.0) * 4.0 * s.B * s.H * double(L) * L * E / (causal ? 2 : 1);
      printf("| %s | %d | %d | %d | %.0f | %.0f | %.3f | %.3g |\n", backward ? "bwd" : "fwd", E, causal, L,
             flops / tb[15] / 1e9, flops / th[15] / 1e9, tb[15] / th[15], diff);
      for (void* p : {(void*)in.q, (void*)in.k, (void*)in.v, (void*)o, (void*)in.lse, (void*)dout, (void*)dq,
                      (void*)dk, (void*)dv, workspace}) cudaFree(p);
    }
  }
}

int main() {
  printf("| pass | E | causal | L | base TFLOP/s | head TFLOP/s | head/base | max diff |\n"
         "|---|---|---|---|---|---|---|---|\n");
  compare(false, 64);
  compare(false, 128);
  compare(true, 128);
}
