"""Fake kernels, the autograd formula and the functional entry point of the ops.

The fake kernels return exactly the strides the real kernels do (outputs in
(B, L, H, E) memory, seen as (B, H, L, E)), so compiled graphs and Inductor's
stride assertions agree with eager execution.
"""
import math

import torch

from . import _library  # noqa: F401  (registers the ops)

_ops = torch.ops.torch_flash_backend
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _empty_blhe(ref: torch.Tensor, b, h, length, e) -> torch.Tensor:
    return ref.new_empty((b, length, h, e)).transpose(1, 2)


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
    if v.size(3) != q.size(3):
        raise ValueError(f"v head_dim ({v.size(3)}) must equal q head_dim ({q.size(3)})")
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


@torch.library.register_fake("torch_flash_backend::fwd")
def _fwd_fake(q, k, v, scale=None, is_causal=False):
    check_inputs(q, k, v, scale)
    b, h, length, e = q.shape
    return _empty_blhe(q, b, h, length, e), q.new_empty((b, h, length), dtype=torch.float32)


@torch.library.register_fake("torch_flash_backend::bwd")
def _bwd_fake(grad_out, q, k, v, out, lse, scale=None, is_causal=False):
    check_inputs(q, k, v, scale)
    b, hq, length, e = q.shape
    hkv, s = k.size(1), k.size(2)
    return _empty_blhe(q, b, hq, length, e), _empty_blhe(k, b, hkv, s, e), _empty_blhe(v, b, hkv, s, e)


def _kernel_friendly(t: torch.Tensor) -> torch.Tensor:
    """Incoming gradients can have any strides (expanded, offset views); the
    kernels want a contiguous last dim and 16-byte aligned rows."""
    vec = max(1, 16 // t.element_size())
    aligned = t.stride(-1) == 1 and t.storage_offset() % vec == 0
    aligned = aligned and all(t.size(d) <= 1 or t.stride(d) % vec == 0 for d in range(3))
    if aligned:
        return t
    b, h, length, e = t.shape
    return _empty_blhe(t, b, h, length, e).copy_(t)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, is_causal = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.is_causal = scale, is_causal


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _ops.bwd(_kernel_friendly(grad_out), q, k, v, out, lse, ctx.scale, ctx.is_causal)
    return dq, dk, dv, None, None


def _no_double_backward(ctx, *grads):
    raise RuntimeError("torch_flash_backend: double backward (grad of the attention backward) is not supported")


torch.library.register_autograd("torch_flash_backend::fwd", _backward, setup_context=_setup_context)
torch.library.register_autograd("torch_flash_backend::bwd", _no_double_backward)


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """Attention over (B, H, L, E) inputs with this package's kernels; differentiable.

    Takes scaled_dot_product_attention's signature, so a call can swap one for
    the other: causal masking is top-left aligned, ``scale=None`` means
    1/sqrt(E), and k/v may have fewer heads than q (Hq % Hkv == 0) with
    ``enable_gqa=True``. No routing: what the kernels do not support
    (``attn_mask``, ``dropout_p > 0``) raises, naming the argument, instead of
    falling back.
    """
    if attn_mask is not None:
        raise NotImplementedError("flash_attn: attn_mask is not supported (only is_causal masking); "
                                  "use scaled_dot_product_attention under enable() to fall back for it")
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0.0:
        raise NotImplementedError(f"flash_attn: dropout_p={dropout_p!r} is not supported (only 0.0)")
    if not isinstance(is_causal, bool):
        raise TypeError(f"flash_attn: is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"flash_attn: enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    check_inputs(q, k, v, scale)
    if q.size(1) != k.size(1) and not enable_gqa:
        raise ValueError(f"flash_attn: q has {q.size(1)} heads but k/v have {k.size(1)}; pass enable_gqa=True "
                         "for grouped-query attention")
    return _ops.fwd(q, k, v, None if scale is None else float(scale), is_causal)[0]
