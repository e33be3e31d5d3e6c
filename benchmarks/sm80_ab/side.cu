// One side of the A/B: compiled against the working tree's src/ and again
// against the base commit's with -Dtfb=tfb_base, so that each side fills its
// own params struct (the layouts may differ between commits) and launches its
// own kernels. main.cu owns the buffers and takes the sides in turns.
#include <cmath>

#include <cutlass/numeric_types.h>

#include "harness_causal.h"
#include "params.h"
#include "sm80/launch.h"

namespace tfb::ab {

struct Buffers {
  void *q, *k, *v, *o, *dout, *dq, *dk, *dv, *workspace;
  float* lse;
};

namespace {

// (B, L, H, E) memory for every tensor, as the benchmark grid passes them.
template <class P>
void fill_common(P& p, const Buffers& b, int B, int H, int L, int E, bool causal) {
  p.q = b.q; p.k = b.k; p.v = b.v; p.o = b.o; p.lse = b.lse;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(L) * H * E;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = E;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = int64_t(H) * E;
  p.batch = B; p.heads_q = p.heads_kv = H; p.len_q = p.len_k = L; p.head_dim = p.qk_dim = p.v_dim = E;
  p.scale = 1.f / std::sqrt(float(E)); p.scale_log2 = p.scale * 1.4426950408889634f; set_causal(p, causal);
  cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, 0);
}

AttnBwdParams bwd_params(const Buffers& b, int B, int H, int L, int E, bool causal) {
  AttnBwdParams p{};
  fill_common(p, b, B, H, L, E, causal);
  p.dout = b.dout; p.dq = b.dq; p.dk = b.dk; p.dv = b.dv; p.workspace = b.workspace;
  p.do_batch_stride = p.dq_batch_stride = p.dk_batch_stride = p.dv_batch_stride = int64_t(L) * H * E;
  p.do_head_stride = p.dq_head_stride = p.dk_head_stride = p.dv_head_stride = E;
  p.do_row_stride = p.dq_row_stride = p.dk_row_stride = p.dv_row_stride = int64_t(H) * E;
  return p;
}

}  // namespace

cudaError_t fwd(const Buffers& b, int B, int H, int L, int E, bool causal) {
  AttnFwdParams p{};
  fill_common(p, b, B, H, L, E, causal);
  using bf = cutlass::bfloat16_t;
  return E == 64 ? sm80::launch_fwd<bf, 64>(p, 0) : sm80::launch_fwd<bf, 128>(p, 0);
}

size_t bwd_workspace_bytes(int B, int H, int L, int E, bool causal) {
  return sm80::bwd_workspace_bytes_impl(bwd_params(Buffers{}, B, H, L, E, causal));
}

cudaError_t bwd(const Buffers& b, int B, int H, int L, int E, bool causal) {
  return sm80::launch_bwd<cutlass::bfloat16_t, 128>(bwd_params(b, B, H, L, E, causal), 0);
}

}  // namespace tfb::ab
