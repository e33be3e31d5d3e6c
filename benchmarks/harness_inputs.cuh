// Inputs for the standalone timing harnesses (sm90_tiles, sm80_ab): bf16 q/k/v
// in (B, L, H, E) memory, as the benchmark grid passes them, filled on the GPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "harness_causal.h"
#include "params.h"

using bf = cutlass::bfloat16_t;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA error %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

// Fresh standard-normal values (Box-Muller on a hash of the index and a seed),
// made on the GPU: a host generator took longer than the timings. Normal, as
// torch.randn in the benchmark: how often a row's running max moves (and O
// must be rescaled) depends on the tails.
__device__ float hash_unit(uint32_t h) {  // in (0, 1]
  h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
  return (float(h >> 8) + 1.f) / 16777216.f;
}
__global__ void fill(bf* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t base = uint32_t(i) * 2654435761u ^ uint32_t(i >> 32) ^ seed * 0x9e3779b9u;
    const float r = sqrtf(-2.f * logf(hash_unit(base))), t = 6.2831853f * hash_unit(base ^ 0x68e31da4u);
    x[i] = bf(r * cosf(t));
  }
}

tfb::AttnFwdParams make(int B, int H, int L, int E, bool causal, bf** o) {
  size_t n = size_t(B) * L * H * E;
  bf *q, *k, *v; float* l;
  CK(cudaMalloc(&q, n * 2)); CK(cudaMalloc(&k, n * 2)); CK(cudaMalloc(&v, n * 2)); CK(cudaMalloc(o, n * 2)); CK(cudaMalloc(&l, size_t(B) * H * L * 4));
  fill<<<1024, 256>>>(q, n, 3 * (E + L)); fill<<<1024, 256>>>(k, n, 3 * (E + L) + 1); fill<<<1024, 256>>>(v, n, 3 * (E + L) + 2);
  CK(cudaGetLastError());
  tfb::AttnFwdParams p{};
  p.q = q; p.k = k; p.v = v; p.o = *o; p.lse = l;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(L) * H * E;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = E;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = int64_t(H) * E;
  p.batch = B; p.heads_q = p.heads_kv = H; p.len_q = p.len_k = L; p.head_dim = p.qk_dim = p.v_dim = E;
  p.scale = 1.f / std::sqrt(float(E)); p.scale_log2 = p.scale * 1.4426950408889634f; set_causal(p, causal);
  cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, 0);
  return p;
}
