"""Fake (meta) kernels of the ops, for torch.compile and torch.export.

They return exactly the strides the real kernels do (outputs in (B, L, H, E)
memory, seen as (B, H, L, E)), so compiled graphs and Inductor's stride
assertions agree with eager execution.
"""
import torch

from . import _library  # noqa: F401  (registers the ops)
from ._checks import check_band, check_dropout, check_family, check_inputs, check_mask, check_varlen


def empty_blhe(ref: torch.Tensor, b, h, length, e) -> torch.Tensor:
    return ref.new_empty((b, length, h, e)).transpose(1, 2)


@torch.library.register_fake("torch_flash_backend::fwd")
def _fwd_fake(q, k, v, scale=None, is_causal=False, family=None, backward_family=None, attn_mask=None,
              bottom_right=False, window_left=-1, window_right=-1):
    check_inputs(q, k, v, scale)
    check_mask(attn_mask, q, k, scale)
    check_band(attn_mask, is_causal, window_left, window_right)
    check_family(family, q, k, "forward")
    b, h, length, _ = q.shape
    return empty_blhe(q, b, h, length, v.size(3)), q.new_empty((b, h, length), dtype=torch.float32)


@torch.library.register_fake("torch_flash_backend::bwd")
def _bwd_fake(grad_out, q, k, v, out, lse, scale=None, is_causal=False, family=None, attn_mask=None,
              bottom_right=False, window_left=-1, window_right=-1):
    check_inputs(q, k, v, scale)
    check_mask(attn_mask, q, k, scale)
    check_band(attn_mask, is_causal, window_left, window_right)
    check_family(family, q, k, "backward")
    b, hq, length, e = q.shape
    hkv, s = k.size(1), k.size(2)
    return empty_blhe(q, b, hq, length, e), empty_blhe(k, b, hkv, s, e), empty_blhe(v, b, hkv, s, v.size(3))


@torch.library.register_fake("torch_flash_backend::dropout_fwd")
def _dropout_fwd_fake(q, k, v, dropout_p, scale=None, is_causal=False, family=None, backward_family=None,
                      attn_mask=None, bottom_right=False, window_left=-1, window_right=-1):
    check_dropout(dropout_p)
    out, lse = _fwd_fake(q, k, v, scale, is_causal, family, backward_family, attn_mask, bottom_right, window_left,
                         window_right)
    return out, lse, q.new_empty((2,), dtype=torch.int64)


@torch.library.register_fake("torch_flash_backend::dropout_bwd")
def _dropout_bwd_fake(grad_out, q, k, v, out, lse, rng_state, dropout_p, scale=None, is_causal=False, family=None,
                      attn_mask=None, bottom_right=False, window_left=-1, window_right=-1):
    check_dropout(dropout_p)
    return _bwd_fake(grad_out, q, k, v, out, lse, scale, is_causal, family, attn_mask, bottom_right, window_left,
                     window_right)


@torch.library.register_fake("torch_flash_backend::dropout_mask")
def _dropout_mask_fake(rng_state, dropout_p, batch, heads, len_q, len_k):
    check_dropout(dropout_p)
    return rng_state.new_empty((batch, heads, len_q, len_k), dtype=torch.bool)


@torch.library.register_fake("torch_flash_backend::varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, is_causal=False, family=None,
                     backward_family=None, window_left=-1, window_right=-1, seqused_k=None):
    check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k)
    check_band(None, is_causal, window_left, window_right)
    return q.new_empty((q.size(0), q.size(1), v.size(2))), q.new_empty((q.size(1), q.size(0)), dtype=torch.float32)


@torch.library.register_fake("torch_flash_backend::varlen_bwd")
def _varlen_bwd_fake(grad_out, q, k, v, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, is_causal=False,
                     family=None, window_left=-1, window_right=-1, seqused_k=None):
    check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k)
    check_band(None, is_causal, window_left, window_right)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _check_fp8(q, k, v, descales, batch, heads_kv):
    torch._check(q.dtype == torch.float8_e4m3fn, lambda: f"FP8 attention takes float8_e4m3fn q, k, v, got {q.dtype}")
    torch._check(k.dtype == q.dtype and v.dtype == q.dtype, lambda: "q, k and v must share one dtype")
    for name, d in descales.items():
        if d is not None:
            torch._check(d.dtype == torch.float32, lambda name=name, d=d: f"{name} must be float32, got {d.dtype}")
            torch._check(d.dim() == 2 and d.size(0) == batch and d.size(1) == heads_kv,
                         lambda name=name, d=d: f"{name} must have shape (batch, kv heads) = ({batch}, {heads_kv}), "
                                                f"got {tuple(d.shape)}")


@torch.library.register_fake("torch_flash_backend::fp8_fwd")
def _fp8_fwd_fake(q, k, v, q_descale=None, k_descale=None, v_descale=None, scale=None, is_causal=False,
                  bottom_right=False):
    b, h, length, e = q.shape
    _check_fp8(q, k, v, {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}, b, k.size(1))
    out = q.new_empty((b, length, h, e), dtype=torch.bfloat16).transpose(1, 2)
    return out, q.new_empty((b, h, length), dtype=torch.float32)


@torch.library.register_fake("torch_flash_backend::fp8_varlen_fwd")
def _fp8_varlen_fwd_fake(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, q_descale=None, k_descale=None, v_descale=None,
                         scale=None, is_causal=False, seqused_k=None):
    _check_fp8(q, k, v, {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale},
               cu_seq_q.size(0) - 1, k.size(1))
    return q.new_empty(q.shape, dtype=torch.bfloat16), q.new_empty((q.size(1), q.size(0)), dtype=torch.float32)
