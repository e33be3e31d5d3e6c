#include "device.h"

#include <mutex>
#include <vector>

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

namespace tfb {

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

}  // namespace tfb
