"""The public function: scaled_dot_product_attention's signature on our ops."""
import torch

from . import _autograd  # noqa: F401  (the ops, fake kernels and autograd)
from . import _router
from ._causal import causal_flags
from ._checks import check_inputs, check_mask

_ops = torch.ops.torch_flash_backend


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """Attention over (B, H, L, E) inputs with this package's kernels; differentiable.

    Takes scaled_dot_product_attention's signature, so a call can swap one for
    the other: causal masking is top-left aligned, ``scale=None`` means
    1/sqrt(E), and k/v may have fewer heads than q (Hq % Hkv == 0) with
    ``enable_gqa=True``; an ``attn_mask``, boolean (True = take part) or
    additive (q's dtype or float32, added to the scaled scores), broadcasts
    to (B, Hq, L, S) and is read in place, the tiles it hides skipped; a
    ``CausalBias`` (``torch.nn.attention.bias.causal_lower_right`` /
    ``causal_upper_left``) is causal masking of that alignment.
    ``dropout_p`` in (0, 1) drops each (query, key) pair of P with that
    probability (CUDA; drawn from PyTorch's CUDA generator, so
    ``torch.manual_seed`` reproduces a call and its gradients). No routing:
    what the kernels do not support (dropout on CPU, a mask that requires
    grad) raises, naming the argument, instead of falling back. The kernels
    are the router's choice among every family that can run the call
    (enable()'s speed rules aside), within the families
    ``TFB_KERNEL_FAMILIES`` allows.
    """
    if type(dropout_p) not in (int, float) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"flash_attn: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p != 0.0 and q.device.type != "cuda":
        raise NotImplementedError(f"flash_attn: dropout_p={dropout_p!r} on {q.device}: the CPU ops draw no dropout")
    if not isinstance(is_causal, bool):
        raise TypeError(f"flash_attn: is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"flash_attn: enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    attn_mask, is_causal, bottom_right = causal_flags(attn_mask, is_causal, "flash_attn")
    check_inputs(q, k, v, scale)
    if q.size(1) != k.size(1) and not enable_gqa:
        raise ValueError(f"flash_attn: q has {q.size(1)} heads but k/v have {k.size(1)}; pass enable_gqa=True "
                         "for grouped-query attention")
    if attn_mask is not None:
        check_mask(attn_mask, q, k, scale)
        if attn_mask.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("flash_attn: attn_mask requires grad; the kernels give no gradient for a mask")
        if is_causal:
            raise ValueError("flash_attn: pass attn_mask or is_causal=True, not both (as scaled_dot_product_attention)")
    family, backward_family = _router.pinned_families(q, k, v, attn_mask, is_causal, scale, enable_gqa, bottom_right,
                                                      dropout_p=float(dropout_p))
    extra = {} if attn_mask is None else {"attn_mask": attn_mask}
    if bottom_right:
        extra["bottom_right"] = True
    if dropout_p != 0.0:
        return _ops.dropout_fwd(q, k, v, float(dropout_p), None if scale is None else float(scale), is_causal,
                                family, backward_family, **extra)[0]
    return _ops.fwd(q, k, v, None if scale is None else float(scale), is_causal, family, backward_family,
                    **extra)[0]
