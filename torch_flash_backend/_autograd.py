"""The autograd formula of the forward op: its backward is the bwd op, which
recomputes attention from the saved logsumexp, with the backward family the
forward's caller chose (its backward_family argument)."""
import torch

from . import _fake  # noqa: F401  (the ops and their fake kernels)
from ._checks import kernel_friendly
from ._library import reads_stride0

_ops = torch.ops.torch_flash_backend


def _setup_context(ctx, inputs, output):
    q, k, v, scale, is_causal, _family, backward_family, attn_mask, bottom_right, window_left, window_right = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.scale, ctx.is_causal, ctx.backward_family, ctx.bottom_right = scale, is_causal, backward_family, bottom_right
    ctx.window = window_left, window_right
    ctx.mask_requires_grad = attn_mask is not None and attn_mask.requires_grad


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    if ctx.mask_requires_grad:
        # The router passes such calls to PyTorch's SDPA; a direct caller learns here.
        raise RuntimeError("torch_flash_backend: attn_mask requires grad, and the kernels give no gradient for "
                           "a mask; detach it, or call PyTorch's scaled_dot_product_attention")
    # Arguments at their defaults stay out, so that backward graphs without them read as before.
    extra = {} if attn_mask is None else {"attn_mask": attn_mask}
    if ctx.bottom_right:
        extra["bottom_right"] = True
    if ctx.window != (-1, -1):
        extra["window_left"], extra["window_right"] = ctx.window
    family = ctx.backward_family
    # A named family runs the call or raises: a gradient broadcast with stride 0
    # is made dense for one that cannot read it (TMA).
    dq, dk, dv = _ops.bwd(kernel_friendly(grad_out, reads_stride0(family)), q, k, v, out, lse, ctx.scale,
                          ctx.is_causal, family, **extra)
    # The mask gets none (refused above where it asked for one).
    return dq, dk, dv, None, None, None, None, None, None, None, None


def _dropout_setup_context(ctx, inputs, output):
    (q, k, v, dropout_p, scale, is_causal, _family, backward_family, attn_mask, bottom_right, window_left,
     window_right) = inputs
    out, lse, rng_state = output
    ctx.mark_non_differentiable(lse, rng_state)
    ctx.save_for_backward(q, k, v, out, lse, rng_state, attn_mask)
    ctx.dropout_p, ctx.scale, ctx.is_causal, ctx.backward_family = dropout_p, scale, is_causal, backward_family
    ctx.bottom_right, ctx.window = bottom_right, (window_left, window_right)
    ctx.mask_requires_grad = attn_mask is not None and attn_mask.requires_grad


def _dropout_backward(ctx, grad_out, _grad_lse, _grad_rng_state):
    q, k, v, out, lse, rng_state, attn_mask = ctx.saved_tensors
    if ctx.mask_requires_grad:
        raise RuntimeError("torch_flash_backend: attn_mask requires grad, and the kernels give no gradient for "
                           "a mask; detach it, or call PyTorch's scaled_dot_product_attention")
    family = ctx.backward_family
    dq, dk, dv = _ops.dropout_bwd(kernel_friendly(grad_out, reads_stride0(family)), q, k, v, out, lse, rng_state,
                                  ctx.dropout_p, ctx.scale, ctx.is_causal, family, attn_mask, ctx.bottom_right,
                                  *ctx.window)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _no_double_backward(ctx, *grads):
    raise RuntimeError("torch_flash_backend: double backward (grad of the attention backward) is not supported")


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale, is_causal, _family, backward_family, window_left, window_right,
     seqused_k) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_seq_q, cu_seq_k, seqused_k)
    ctx.args = max_q, max_k, scale, is_causal, backward_family, window_left, window_right


def _varlen_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_seq_q, cu_seq_k, seqused_k = ctx.saved_tensors
    max_q, max_k, scale, is_causal, family, window_left, window_right = ctx.args
    dq, dk, dv = _ops.varlen_bwd(grad_out.contiguous(), q, k, v, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                                 is_causal, family, window_left, window_right, seqused_k)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("torch_flash_backend::fwd", _backward, setup_context=_setup_context)
torch.library.register_autograd("torch_flash_backend::bwd", _no_double_backward)
torch.library.register_autograd("torch_flash_backend::dropout_fwd", _dropout_backward,
                                setup_context=_dropout_setup_context)
torch.library.register_autograd("torch_flash_backend::dropout_bwd", _no_double_backward)
torch.library.register_autograd("torch_flash_backend::varlen_fwd", _varlen_backward,
                                setup_context=_varlen_setup_context)
torch.library.register_autograd("torch_flash_backend::varlen_bwd", _no_double_backward)
