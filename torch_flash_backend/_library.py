"""Loads the op library once; everything else in the package goes through the ops it registers."""
import os

import torch

from ._release import release

LIB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libtorch_flash_backend.so")
REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps <source tree>"


def torch_mismatch(built_torch: str, built_cuda: str | None, torch_version: str, torch_cuda: str | None) -> str | None:
    """Why a library built against torch built_torch (CUDA built_cuda, None for a
    CPU-only build) cannot load beside torch torch_version (CUDA torch_cuda), or
    None when it can."""
    built = f"torch {built_torch}" + (f" (CUDA {built_cuda})" if built_cuda else "")
    found = f"torch {torch_version}" + (f" (CUDA {torch_cuda})" if torch_cuda else " (no CUDA)")
    if release(built_torch) != release(torch_version):
        problem = f"it was built for torch {release(built_torch)}.* ({built_torch}), and {found} is installed"
    elif built_cuda and (torch_cuda or "").split(".")[0] != built_cuda.split(".")[0]:
        problem = f"it was built for {built}, and {found} is installed"
    else:
        return None
    return (f"torch_flash_backend cannot load: {problem}. Install torch=={release(built_torch)}.* "
            f"(pip install 'torch=={release(built_torch)}.*'), or rebuild this package against the installed torch "
            f"({REBUILD}).")


def _check_torch() -> None:
    try:
        from . import _built_for  # written by setup.py next to the library
    except ImportError:
        return  # a library without the record (built by CMake, loaded by a C++ host): load_library decides
    why = torch_mismatch(_built_for.TORCH, _built_for.CUDA, torch.__version__, torch.version.cuda)
    if why:
        raise ImportError(why)


def _load() -> None:
    if hasattr(torch.ops.torch_flash_backend, "fwd"):
        return  # already registered, e.g. by a C++ host that loaded the same file
    _check_torch()
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


class Kernel(str):
    """A compiled kernel instantiation: its name ("sm80_fwd_bf16_hdim128", what it
    compares equal to) with the registry's fields (src/registry.py): family,
    pass_ ("fwd"/"bwd"), dtype, head_dim, min_cc and max_cc (major * 10 + minor;
    max_cc 0: no upper bound), stride0_ok, align_bytes, max_rows (query rows per kv
    head the family serves at most, the group's heads times the query length; 0:
    no limit), masks (this pass reads a boolean attn_mask), additive_masks (and an
    additive one), windows (a band's left edge, window_left), seqlens (per-sequence
    lengths: packed variable-length batches and seqused_k), pads (serves smaller
    head dims, and a value head dim unlike the query's: serving_kernel), dropout
    (draws dropout on P: the dropout ops),
    smem_bytes, tile_rows and tile_keys (the tile whose mask bytes the kernel
    skips together; 0 where it reads no mask)."""

    family: str
    pass_: str
    dtype: str
    head_dim: int
    min_cc: int
    max_cc: int
    stride0_ok: bool
    align_bytes: int
    max_rows: int
    masks: bool
    additive_masks: bool
    windows: bool
    seqlens: bool
    pads: bool
    dropout: bool
    smem_bytes: int
    tile_rows: int
    tile_keys: int

    @classmethod
    def parse(cls, line: str) -> "Kernel":
        name, *fields = line.split()
        values = dict(f.split("=", 1) for f in fields)
        kernel = cls(name)
        kernel.family, kernel.pass_, kernel.dtype = values["family"], values["pass"], values["dtype"]
        for key in ("head_dim", "min_cc", "max_cc", "align_bytes", "smem_bytes"):
            setattr(kernel, key, int(values[key]))
        kernel.max_rows = int(values.get("max_rows", 0))
        kernel.tile_rows, kernel.tile_keys = int(values.get("tile_rows", 0)), int(values.get("tile_keys", 0))
        kernel.stride0_ok = values["stride0_ok"] in ("1", "true")
        kernel.masks = kernel.pass_ in values.get("masks", "").split(",")
        kernel.additive_masks = kernel.pass_ in values.get("additive_masks", values.get("masks", "")).split(",")
        kernel.windows = kernel.pass_ in values.get("windows", "").split(",")
        kernel.seqlens = kernel.pass_ in values.get("seqlens", "").split(",")
        kernel.pads = kernel.pass_ in values.get("pads", "").split(",")
        kernel.dropout = kernel.pass_ in values.get("dropout", "").split(",")
        return kernel

    def reads_mask(self, mask_kind: str) -> bool:
        """Whether this pass reads a call's mask: mask_kind "" (none, or a band
        without a left edge), "bool", "additive" or "window" (a left edge)."""
        if mask_kind == "window":
            return self.windows
        return not mask_kind or (self.additive_masks if mask_kind == "additive" else self.masks)

    def runs_on(self, capability: tuple[int, int]) -> bool:
        return _cc_in(capability, self.min_cc, self.max_cc)


def serving_kernel(kernels, family: str, pass_: str, dtype: str, qk_dim: int, v_dim: int) -> Kernel | None:
    """The instantiation of (family, pass_, dtype) among these records that runs
    q and k of qk_dim columns and v of v_dim: csrc/cuda/families.cpp
    serving_head_dim's rule (test_head_dims.py holds the two together) — the
    same head dim where one was built, else, for a pass that pads, the smallest
    one at least as large as both when both are multiples of 8; None: none."""
    mine = sorted((k for k in kernels if k.family == family and k.pass_ == pass_ and k.dtype == dtype),
                  key=lambda k: k.head_dim)
    exact = next((k for k in mine if k.head_dim == qk_dim == v_dim), None)
    if exact is not None or not mine or not mine[0].pads:
        return exact
    if qk_dim <= 0 or v_dim <= 0 or qk_dim % 8 or v_dim % 8:
        return None
    return next((k for k in mine if k.head_dim >= max(qk_dim, v_dim)), None)


def _cc_in(capability: tuple[int, int], min_cc: int, max_cc: int) -> bool:
    """Whether a compute capability lies in a registry range (max_cc 0: no upper bound;
    sm_90a code runs on 9.0 alone). csrc/cuda/families.h's runs_on is the C++ side."""
    cc = capability[0] * 10 + capability[1]
    return min_cc <= cc and (max_cc == 0 or cc <= max_cc)


# Read once, at import: the registry is fixed when the library is built, and
# these ops return strings, which a trace (torch.export, make_fx) that made
# the first routed call could not record.
_FAMILY_LIMITS = dict(line.split(" ", 1) for line in torch.ops.torch_flash_backend.kernel_families())
_BUILT_KERNELS = frozenset(Kernel.parse(line) for line in torch.ops.torch_flash_backend.built_kernels())
_CONSTANTS = {name: float(value) for name, value in (line.split("=", 1)
                                                      for line in torch.ops.torch_flash_backend.constants())}


def constant(name: str) -> float:
    """A number the kernels define (src/common/constants.h, mask_values.h), as the
    library reports it: "additive_limit", "additive_min_scale"."""
    return _CONSTANTS[name]


# Each family's limits as fields, parsed once: the router reads them per call.
_FAMILY_FIELDS = {family: dict(f.split("=", 1) for f in limits.split()) for family, limits in _FAMILY_LIMITS.items()}
_ALIGN_BYTES = {family: int(fields["align_bytes"]) for family, fields in _FAMILY_FIELDS.items()}
_ALIGN_BYTES_MAX = max(_ALIGN_BYTES.values())


def align_bytes(family: str | None = None) -> int:
    """The boundary every input row of the named family's kernels starts on
    (the registry's align_bytes); None: the largest any family asks."""
    return _ALIGN_BYTES.get(family, _ALIGN_BYTES_MAX)


def family_limits() -> dict[str, str]:
    """Family name -> its limits as "key=value ..." (the registry's, built or not),
    in the router's order of preference."""
    return dict(_FAMILY_LIMITS)


def family_runs_on(family: str, capability: tuple[int, int]) -> bool:
    """Whether the named family's machine code runs on this compute capability."""
    fields = _FAMILY_FIELDS[family]
    return _cc_in(capability, int(fields["min_cc"]), int(fields["max_cc"]))


def reads_stride0(family: str | None) -> bool:
    """Whether the named family reads inputs broadcast with stride 0; None (the
    library picks a family that can) counts as yes."""
    if family is None or family not in _FAMILY_FIELDS:
        return True
    return _FAMILY_FIELDS[family]["stride0_ok"] in ("1", "true")


def built_kernel_set() -> frozenset[Kernel]:
    return _BUILT_KERNELS


def built_kernels() -> list[Kernel]:
    """The CUDA kernel instantiations compiled into the library, sorted; each is
    its name (e.g. "sm80_fwd_bf16_hdim128") with the registry's fields as
    attributes (Kernel). Empty for a CPU-only build."""
    return sorted(built_kernel_set())
