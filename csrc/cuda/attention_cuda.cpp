// CUDA impls of the ops: check, fill the params struct, launch the kernel the
// device's family provides on the current stream.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "api.h"
#include "attention.h"

namespace tfb {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

struct DeviceInfo {
  int major = 0, minor = 0, num_sms = 0;
};

const DeviceInfo& device_info(int device) {
  static std::mutex mu;
  static std::vector<DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (cache.empty()) {
    int count = 0;
    C10_CUDA_CHECK(cudaGetDeviceCount(&count));
    cache.resize(count);
  }
  DeviceInfo& info = cache.at(device);
  if (info.num_sms == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device));
  }
  return info;
}

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

constexpr const char* kFamiliesEnv = "TFB_KERNEL_FAMILIES";

std::string_view trim(std::string_view s) {
  const size_t first = s.find_first_not_of(" \t");
  return first == std::string_view::npos ? std::string_view() : s.substr(first, s.find_last_not_of(" \t") - first + 1);
}

// TFB_KERNEL_FAMILIES (comma-separated names, e.g. "sm80"; unset or naming
// none: all) limits the families these ops launch, as it limits the Python
// router. Read on every call: a process may change it between calls.
bool family_allowed(std::string_view family) {
  const char* env = std::getenv(kFamiliesEnv);
  std::string_view rest = env == nullptr ? "" : env;
  bool names_any = false;
  while (!rest.empty()) {
    const size_t end = std::min(rest.find(','), rest.size());
    const std::string_view name = trim(rest.substr(0, end));
    rest.remove_prefix(std::min(end + 1, rest.size()));
    if (name == family) return true;
    names_any = names_any || !name.empty();
  }
  return !names_any;
}

// Every pass falls back on sm80; the error names the switch that took it away.
void check_sm80(bool built, const char* pass, const at::Tensor& q, const AttnShape& s) {
  TORCH_CHECK(family_allowed("sm80"), kFamiliesEnv, "=\"", std::getenv(kFamiliesEnv),
              "\" excludes sm80, the only kernel family that can run this ", pass, " (head_dim=", s.head_dim,
              ", dtype ", q.scalar_type(), ", ", q.device(), ")");
  TORCH_CHECK(built, "no sm80 ", pass, " kernel was built for head_dim=", s.head_dim, " and dtype ", q.scalar_type());
}


// As PyTorch's flash backward: torch.use_deterministic_algorithms(True) sums
// dQ in a fixed order; with warn_only=True the default (atomic) order runs
// and says so once.
bool deterministic_bwd() {
  auto& ctx = at::globalContext();
  if (!ctx.deterministicAlgorithms()) return false;
  if (ctx.deterministicAlgorithmsWarnOnly()) {
    TORCH_WARN_ONCE(
        "torch_flash_backend's attention backward defaults to a non-deterministic algorithm (dQ is summed with "
        "atomics). To explicitly enable determinism call torch.use_deterministic_algorithms(True, warn_only=False).");
    return false;
  }
  return true;
}

void fill_fwd(AttnFwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& lse, const AttnShape& s, double scale, bool is_causal) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(2);
  p.batch = static_cast<int>(s.batch);
  p.heads_q = static_cast<int>(s.heads_q);
  p.heads_kv = static_cast<int>(s.heads_kv);
  p.len_q = static_cast<int>(s.len_q);
  p.len_k = static_cast<int>(s.len_k);
  p.head_dim = static_cast<int>(s.head_dim);
  p.scale = static_cast<float>(scale);
  // The kernels mask scores to -inf before scaling them: a zero (or denormal)
  // scale_log2 would make -inf * 0 = NaN. At FLT_MIN every finite score scales
  // to about 0, so a zero scale still gives uniform attention.
  const float scale_log2 = static_cast<float>(scale) * kLog2e;
  p.scale_log2 = std::fabs(scale_log2) < FLT_MIN ? std::copysign(FLT_MIN, scale_log2) : scale_log2;
  p.is_causal = is_causal;
  p.num_sms = device_info(q.get_device()).num_sms;
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
  fill_fwd(p, q, k, v, out, lse, s, softmax_scale(scale, s.head_dim), is_causal);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  // sm_90a code runs on compute capability 9.0 alone, not on later chips.
  const bool use_sm90 = info.major == 9 && info.minor == 0 && family_allowed("sm90") &&
                        sm90::has_fwd(dtype, p.head_dim) && sm90::can_run_fwd(p);
  if (!use_sm90) check_sm80(sm80::has_fwd(dtype, p.head_dim), "forward", q, s);
  const cudaError_t err = use_sm90 ? sm90::run_fwd(p, dtype, stream) : sm80::run_fwd(p, dtype, stream);
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
  check_cuda_device(q);
  check_sm80(sm80::has_bwd(to_dtype(q), s.head_dim), "backward", q, s);
  check_vector_aligned(q, "q");
  check_vector_aligned(k, "k");
  check_vector_aligned(v, "v");
  check_vector_aligned(out, "out");
  check_vector_aligned(grad_out, "grad_out");
  AttnBwdParams p{};
  fill_fwd(p, q, k, v, out, lse, s, softmax_scale(scale, s.head_dim), is_causal);
  p.deterministic = deterministic_bwd();
  p.dout = grad_out.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.do_batch_stride = grad_out.stride(0), p.do_head_stride = grad_out.stride(1), p.do_row_stride = grad_out.stride(2);
  p.dq_batch_stride = dq.stride(0), p.dq_head_stride = dq.stride(1), p.dq_row_stride = dq.stride(2);
  p.dk_batch_stride = dk.stride(0), p.dk_head_stride = dk.stride(1), p.dk_row_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0), p.dv_head_stride = dv.stride(1), p.dv_row_stride = dv.stride(2);
  at::Tensor workspace = at::empty({static_cast<int64_t>(sm80::bwd_workspace_bytes(p))}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  const cudaError_t err = sm80::run_bwd(p, to_dtype(q), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "torch_flash_backend bwd launch failed: ", cudaGetErrorString(err));
  return {dq, dk, dv};
}

}  // namespace
}  // namespace tfb

TORCH_LIBRARY_IMPL(torch_flash_backend, CUDA, m) {
  m.impl("fwd", &tfb::fwd_cuda);
  m.impl("bwd", &tfb::bwd_cuda);
}
