// CUDA impls of the ops: check the arguments, fill the params struct
// (fill_params.h), launch the family families.h chooses on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "api.h"
#include "checks.h"
#include "device.h"
#include "families.h"
#include "fill_params.h"

namespace tfb {
namespace {

DType to_dtype(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "CUDA kernels take float16 or bfloat16 inputs, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? DType::kFloat16 : DType::kBFloat16;
}

// The kernels move 16-byte vectors: every row must start on a 16-byte boundary.
void check_vector_aligned(const at::Tensor& t, const char* name) {
  const int64_t vec = 16 / t.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " data pointer must be 16-byte aligned");
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(t.size(d) <= 1 || t.stride(d) % vec == 0, name, " stride(", d, ") = ", t.stride(d),
                " must be a multiple of ", vec, " elements (16 bytes)");
  }
}

const DeviceInfo& check_cuda_device(const at::Tensor& q) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  const DeviceInfo& info = device_info(q.get_device());
  TORCH_CHECK(info.major >= 8, "torch_flash_backend CUDA kernels need compute capability >= 8.0, device ",
              q.device(), " has ", info.major, ".", info.minor);
  return info;
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            std::optional<double> scale, bool is_causal) {
  const AttnShape s = check_qkv(q, k, v);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out, lse;
  std::tie(out, lse) = fwd_outputs(q, s);
  if (is_empty_problem(s)) return {out, lse};
  const DeviceInfo& info = check_cuda_device(q);
  const DType dtype = to_dtype(q);
  check_vector_aligned(q, "q");
  check_vector_aligned(k, "k");
  check_vector_aligned(v, "v");
  AttnFwdParams p{};
  fill_fwd(p, q, k, v, out, lse, s, softmax_scale(scale, s.head_dim), is_causal, info.num_sms);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = forward_family(info, dtype, p, q, s) == Family::kSm90 ? sm90::run_fwd(p, dtype, stream)
                                                                                 : sm80::run_fwd(p, dtype, stream);
  TORCH_CHECK(err == cudaSuccess, "torch_flash_backend fwd launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& lse,
                                                        std::optional<double> scale, bool is_causal) {
  const AttnShape s = check_qkv(q, k, v);
  check_bwd_extra(grad_out, out, lse, q, s);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor dq, dk, dv;
  std::tie(dq, dk, dv) = bwd_outputs(q, k, v, s);
  if (is_empty_problem(s)) return {dq, dk, dv};
  const DeviceInfo& info = check_cuda_device(q);
  const DType dtype = to_dtype(q);
  check_backward(dtype, q, s);
  check_vector_aligned(q, "q");
  check_vector_aligned(k, "k");
  check_vector_aligned(v, "v");
  check_vector_aligned(out, "out");
  check_vector_aligned(grad_out, "grad_out");
  AttnBwdParams p{};
  fill_fwd(p, q, k, v, out, lse, s, softmax_scale(scale, s.head_dim), is_causal, info.num_sms);
  fill_bwd(p, grad_out, dq, dk, dv);
  at::Tensor workspace = at::empty({static_cast<int64_t>(sm80::bwd_workspace_bytes(p))}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  const cudaError_t err = sm80::run_bwd(p, dtype, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "torch_flash_backend bwd launch failed: ", cudaGetErrorString(err));
  return {dq, dk, dv};
}

}  // namespace
}  // namespace tfb

TORCH_LIBRARY_IMPL(torch_flash_backend, CUDA, m) {
  m.impl("fwd", &tfb::fwd_cuda);
  m.impl("bwd", &tfb::bwd_cuda);
}
