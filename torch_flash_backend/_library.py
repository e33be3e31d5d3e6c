"""Loads the op library once; everything else in the package goes through the ops it registers."""
import functools
import os

import torch

LIB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libtorch_flash_backend.so")


def _load() -> None:
    if hasattr(torch.ops.torch_flash_backend, "fwd"):
        return  # already registered, e.g. by a C++ host that loaded the same file
    if not os.path.exists(LIB_PATH):
        raise ImportError(
            f"torch_flash_backend: the op library {LIB_PATH} is missing. Build it from the source "
            "tree with `python setup.py build_ext --inplace` (add TFB_BUILD_CUDA=0 for a CPU-only build)."
        )
    try:
        torch.ops.load_library(LIB_PATH)
    except OSError as e:
        raise ImportError(
            f"torch_flash_backend: cannot load {LIB_PATH} ({e}). It must be built against the installed "
            f"torch {torch.__version__}; rebuild with `python setup.py build_ext --inplace`."
        ) from e


_load()


@functools.cache
def built_kernel_set() -> frozenset[str]:
    return frozenset(torch.ops.torch_flash_backend.built_kernels())


def built_kernels() -> list[str]:
    """Names of the CUDA kernel instantiations compiled into the library, e.g.
    "sm80_fwd_bf16_hdim128"; empty for a CPU-only build."""
    return sorted(built_kernel_set())
