"""Argument checks, each rule once: the ops' inputs (shared by the fake kernels
and the public function), the SDPA arguments every backend rejects, and the
layout rule of the kernels' vector loads (the registry's align_bytes)."""
import math

import torch

from ._library import align_bytes, constant, family_limits

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> None:
    """Raises ValueError naming the offending argument; the C++ impls check the same."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested or t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense strided tensor (nested and sparse are not supported)")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, length, head_dim), got shape {tuple(t.shape)}")
        if t.stride(-1) != 1 and t.size(-1) > 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1), got strides {t.stride()}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share one device")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all inputs must share one dtype")
    if q.dtype not in _DTYPES or (q.dtype == torch.float32 and q.device.type == "cuda"):
        raise ValueError(f"q has dtype {q.dtype}; expected float16 or bfloat16 (float32 only on CPU)")
    if not (k.size(0) == q.size(0) == v.size(0)):
        raise ValueError(f"batch sizes differ: q {q.size(0)}, k {k.size(0)}, v {v.size(0)}")
    if k.size(3) != q.size(3):
        raise ValueError(f"k head_dim ({k.size(3)}) must equal q head_dim ({q.size(3)})")
    if k.size(1) != v.size(1):
        raise ValueError(f"k has {k.size(1)} heads but v has {v.size(1)}")
    if k.size(2) != v.size(2):
        raise ValueError(f"k has length {k.size(2)} but v has length {v.size(2)}")
    hq, hkv = q.size(1), k.size(1)
    if (hq % hkv != 0) if hkv > 0 else hq != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv}) for grouped-query attention")
    if scale is not None:
        if not isinstance(scale, (int, float, torch.SymFloat)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if isinstance(scale, (int, float)) and not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}")


# src/common/mask_values.h kAdditiveMinScale, read from the library.
ADDITIVE_MIN_SCALE = constant("additive_min_scale")


def mask_dtype_problem(attn_mask: torch.Tensor, q: torch.Tensor, scale=None) -> str | None:
    """Why the ops cannot read attn_mask's dtype, or None: a boolean mask (True
    = take part), or an additive one (added to the scaled scores; -inf hides)
    in q's dtype or float32, as SDPA takes them. An additive mask needs
    |scale| >= 1e-30: the kernels add value / scale to the unscaled scores."""
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in (q.dtype, torch.float32):
        return (f"attn_mask must be a bool tensor (True = take part) or an additive mask in q's dtype ({q.dtype}) "
                f"or float32, got {attn_mask.dtype}")
    if attn_mask.dtype != torch.bool and isinstance(scale, (int, float)) and abs(scale) < ADDITIVE_MIN_SCALE:
        return f"an additive attn_mask needs |scale| >= {ADDITIVE_MIN_SCALE:g}, got scale={scale!r}"
    return None


def check_mask(attn_mask, q: torch.Tensor, k: torch.Tensor, scale=None) -> None:
    """The ops' attn_mask: None, or a tensor on q's device that broadcasts to
    (B, Hq, L, S), boolean or additive (mask_dtype_problem); raises ValueError
    as the C++ impls do."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
    bad_dtype = mask_dtype_problem(attn_mask, q, scale)
    if bad_dtype is not None:
        raise ValueError(bad_dtype)
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}")
    bad_shape = mask_shape_problem(attn_mask, q, k)
    if bad_shape is not None:
        raise ValueError(bad_shape)


def check_band(attn_mask, is_causal: bool, window_left: int, window_right: int) -> None:
    """The ops' band arguments (csrc/checks.h mask_args checks the same): each
    window edge -1 (open) or a number of keys, and no band beside attn_mask."""
    for name, edge in (("window_left", window_left), ("window_right", window_right)):
        if not -1 <= edge < 1 << 30:
            raise ValueError(f"{name} must be -1 (no edge) or a number of keys >= 0, got {edge}")
    if attn_mask is not None and (is_causal or window_left >= 0 or window_right >= 0):
        band = "is_causal=True" if is_causal else "a window (window_left / window_right)"
        raise ValueError(f"attn_mask cannot be combined with {band}; fold the band into the mask instead")


def check_dropout(dropout_p) -> None:
    """The dropout ops' p (csrc/cuda/attention_cuda.cpp dropout_of checks the same)."""
    if not 0.0 < dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in (0, 1), got {dropout_p}")


def check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k=None) -> int:
    """csrc/checks.h check_varlen's rules (the packed ops' metadata, never the
    offsets' values); returns the batch size."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise RuntimeError(f"{name} must be 3-D (total tokens, heads, head_dim) for a packed batch, got shape "
                               f"{tuple(t.shape)}")
        if t.stride(-1) != 1 and t.size(-1) > 1:
            raise RuntimeError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
        if t.device != q.device or t.dtype != q.dtype:
            raise RuntimeError(f"{name} is {t.dtype} on {t.device} but q is {q.dtype} on {q.device}; all inputs "
                               "must share one device and dtype")
    if k.size(2) != q.size(2):
        raise RuntimeError(f"k head_dim ({k.size(2)}) must equal q head_dim ({q.size(2)})")
    if v.shape[:2] != k.shape[:2]:
        raise RuntimeError(f"v shape {tuple(v.shape)} must match k shape {tuple(k.shape)} but for its head dim")
    hq, hkv = q.size(1), k.size(1)
    if (hq % hkv != 0) if hkv > 0 else hq != 0:
        raise RuntimeError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv}) for grouped-query attention")
    for name, t, numel in (("cu_seq_q", cu_seq_q, None), ("cu_seq_k", cu_seq_k, cu_seq_q.numel()),
                           ("seqused_k", seqused_k, cu_seq_q.numel() - 1)):
        if t is None:
            continue
        if t.dtype != torch.int32:
            raise RuntimeError(f"{name} must be an int32 tensor, got {t.dtype}")
        if t.device != q.device:
            raise RuntimeError(f"{name} is on {t.device} but q is on {q.device}")
        if t.dim() != 1 or not t.is_contiguous():
            raise RuntimeError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
        if numel is not None and t.numel() != numel:
            raise RuntimeError(f"{name} must have {numel} elements, got {t.numel()}")
    if cu_seq_q.numel() < 1:
        raise RuntimeError("cu_seq_q must hold batch + 1 offsets, got none")
    # Symbolic lengths (a compiled graph's) are checked when the op runs: comparing them here would guard.
    if not symbolic(max_q, q.size(0)) and not 0 <= max_q <= q.size(0):
        raise RuntimeError(f"max_q must lie in [0, total query tokens {q.size(0)}], got {max_q}")
    if not symbolic(max_k, k.size(0)) and not 0 <= max_k <= k.size(0):
        raise RuntimeError(f"max_k must lie in [0, total key tokens {k.size(0)}], got {max_k}")
    return cu_seq_q.numel() - 1


def symbolic(*values) -> bool:
    """Whether a size is a compiled graph's symbol (comparing it would guard the graph)."""
    return any(isinstance(n, torch.SymInt) for n in values)


def unbacked(*values) -> bool:
    """Whether a size is data-dependent (an .item() in a compiled graph): not even a guard can compare it."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    return any(isinstance(n, torch.SymInt) and free_unbacked_symbols(n) for n in values)


def empty_call(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No batch, head, query or key: the ops answer without a kernel (csrc/checks.h is_empty_problem)."""
    return 0 in (q.size(0), q.size(1), q.size(2), k.size(2))


def check_family(family, q: torch.Tensor, k: torch.Tensor, pass_: str) -> None:
    """The CUDA ops run the family their caller names (csrc/cuda/families.cpp
    choose): None raises there, past the empty calls they answer without a kernel."""
    if family is not None or q.device.type != "cuda" or empty_call(q, k):
        return
    named = "family" if pass_ == "forward" else "the forward's backward_family"
    raise RuntimeError(f"the CUDA {pass_} op runs the family its caller names, and {named} is None (families: "
                       f"{', '.join(family_limits())}; flash_attn() and enable() name the one the router chooses, "
                       "which torch_flash_backend.explain() reports)")


def mask_shape_problem(attn_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why attn_mask does not broadcast to (B, Hq, L, S), as SDPA broadcasts it, or None."""
    full = (q.size(0), q.size(1), q.size(2), k.size(2))
    if attn_mask.dim() > 4 or any(m != 1 and m != f for m, f in zip(reversed(attn_mask.shape), reversed(full))):
        return f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (batch, heads, L, S) = {full}"
    return None


def check_sdpa_args(q, k, v, attn_mask=None, enable_gqa=False) -> None:
    """Raises, naming the argument, for an SDPA call that PyTorch's SDPA rejects
    in every backend: its math path could not run it either. PyTorch 2.11
    crashes on some of these (key head dim != query head dim with enable_gqa:
    SIGSEGV; key or value with 0 heads and enable_gqa: SIGFPE), so they are
    refused here, before any kernel, ours or PyTorch's, sees them."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
    if q.is_nested or k.is_nested or v.is_nested:
        return  # PyTorch's nested paths check their own sizes
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., length, head_dim), got shape {tuple(t.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"key's head dim (size -1) is {k.shape[-1]} but query's is {q.shape[-1]}; they must be equal")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"value's length (size -2) is {v.shape[-2]} but key's is {k.shape[-2]}; they must be equal")
    if enable_gqa and min(q.dim(), k.dim(), v.dim()) >= 3:
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        for name, h in (("key", hk), ("value", hv)):
            if h == 0 or hq % h != 0:
                raise ValueError(f"enable_gqa=True needs {name}'s head count (size -3, here {h}) to divide "
                                 f"query's ({hq})")


def misaligned(name: str, t: torch.Tensor, boundary: int | None = None) -> str | None:
    """Why a (B, H, L, E) tensor breaks the vector rule, or None: a contiguous
    last dim, and every stride along a dim of size > 1 and the storage offset
    multiples of `boundary` bytes (a family's align_bytes; None: the largest any
    family asks). A metadata read (FakeTensors pass too)."""
    bytes_ = align_bytes() if boundary is None else boundary
    vec = max(1, bytes_ // t.element_size())
    shape, stride = t.shape, t.stride()
    if stride[3] != 1 and shape[3] > 1:
        return f"{name} is not contiguous in its last dim (strides {tuple(stride)})"
    for d in range(3):
        if shape[d] > 1 and stride[d] % vec != 0:
            return f"{name} stride({d}) = {stride[d]} is not a multiple of {vec} elements ({bytes_} bytes)"
    if t.storage_offset() % vec != 0:
        return f"{name} storage offset {t.storage_offset()} is not a multiple of {vec} elements ({bytes_} bytes)"
    return None


def broadcast(t: torch.Tensor) -> bool:
    """Whether t has stride 0 along batch, head or row with size > 1 (expand())."""
    return any(size > 1 and stride == 0 for size, stride in zip(t.shape[:3], t.stride()[:3]))


def kernel_friendly(t: torch.Tensor, stride0_ok: bool = True) -> torch.Tensor:
    """Incoming gradients (and outputs the provider hook receives) can have any
    strides (expanded, offset views): a copy in (B, L, H, E) memory when the
    vector rule does not hold, or when t is broadcast with stride 0 (e.g. the
    gradient of out.sum()) and the kernel that reads it cannot read that
    (stride0_ok False: TMA), else t itself."""
    if misaligned("t", t) is None and (stride0_ok or not broadcast(t)):
        return t
    b, h, length, e = t.shape
    return t.new_empty((b, length, h, e)).transpose(1, 2).copy_(t)
