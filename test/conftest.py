import pytest
import torch


def cuda_capability():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_collection_modifyitems(config, items):
    cap = cuda_capability()
    skip = pytest.mark.skip(reason="needs a CUDA GPU of compute capability >= 8.0")
    for item in items:
        if "gpu" in item.keywords and (cap is None or cap[0] < 8):
            item.add_marker(skip)


@pytest.fixture
def host_check(tmp_path):
    """Compiles test/cpp/<name>.cu as host code with nvcc (the kernels' own
    headers, no GPU needed), runs it and returns its output; the program
    prints "ok" last when its checks pass."""
    import os
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(nvcc) or shutil.which("g++") is None or not os.path.isdir(os.path.join(root, "src")):
        pytest.skip("needs nvcc, a host compiler and the source tree")
    cutlass_library = pytest.importorskip("cutlass_library", reason="needs the nvidia-cutlass wheel's headers")
    cutlass = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")

    def run(name):
        exe = tmp_path / name
        subprocess.run([nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_90a", "-I", os.path.join(root, "src"),
                        "-I", cutlass, os.path.join(root, "test", "cpp", name + ".cu"), "-o", str(exe)], check=True)
        return subprocess.run([str(exe)], capture_output=True, text=True).stdout

    return run
