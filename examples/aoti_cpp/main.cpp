// Runs an AOTInductor package whose graph calls torch_flash_backend ops, with
// no Python in the process, and compares its output with one saved by Python.
//
//   aoti_run <libtorch_flash_backend.so> <model.pt2> <inputs.pt> <expected.pt> [tolerance]
//
// inputs.pt is torch.save([tensor, ...]) of the model's inputs, expected.pt is
// torch.save(tensor) of its output. Exit status: 0 match, 1 mismatch or error,
// 2 bad usage or a library that does not load.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace {

c10::IValue load(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, "cannot open ", path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return torch::jit::pickle_load(bytes);
}

int run(const char* package, const char* inputs_path, const char* expected_path, double tolerance) {
  torch::inductor::AOTIModelPackageLoader loader(package);
  // A package is compiled for one device; the saved tensors are on the CPU.
  const std::string device = loader.get_metadata()["AOTI_DEVICE_KEY"];
  const c10::IValue saved_inputs = load(inputs_path);
  std::vector<at::Tensor> inputs;
  for (const c10::IValue& v : saved_inputs.toListRef()) inputs.push_back(v.toTensor().to(device));
  const at::Tensor expected = load(expected_path).toTensor();

  const std::vector<at::Tensor> outputs = loader.run(inputs);
  TORCH_CHECK(outputs.size() == 1, "the model returned ", outputs.size(), " outputs, expected 1");
  const at::Tensor out = outputs[0].cpu();
  TORCH_CHECK(out.sizes() == expected.sizes(), "output shape ", out.sizes(), " != expected ", expected.sizes());
  // NaN compares false below, so a non-finite output fails the check.
  const double diff = (out.to(at::kDouble) - expected.to(at::kDouble)).abs().max().item<double>();
  std::printf("device %s, output %s %s, max |out - expected| = %.3e (tolerance %.1e)\n", device.c_str(),
              c10::toString(out.scalar_type()), c10::str(out.sizes()).c_str(), diff, tolerance);
  return diff <= tolerance ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: %s <libtorch_flash_backend.so> <model.pt2> <inputs.pt> <expected.pt> [tolerance]\n",
                 argv[0]);
    return 2;
  }
  // Loading the library is all it takes: its static initialisers register the
  // ops with the dispatcher, where the package's generated code looks them up.
  if (dlopen(argv[1], RTLD_NOW | RTLD_LOCAL) == nullptr) {
    std::fprintf(stderr, "cannot load the op library: %s\n", dlerror());
    return 2;
  }
  try {
    return run(argv[2], argv[3], argv[4], argc == 6 ? std::atof(argv[5]) : 1e-4);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
