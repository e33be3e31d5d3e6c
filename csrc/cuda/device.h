// What the CUDA ops ask of a device, read once per device and cached.
#pragma once

namespace tfb {

struct DeviceInfo {
  int major = 0, minor = 0, num_sms = 0;
};

// Thread-safe; raises (c10 error) when the CUDA runtime cannot answer.
const DeviceInfo& device_info(int device);

}  // namespace tfb
