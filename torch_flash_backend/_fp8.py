"""FP8 attention: PyTorch's quantized flash ops served by the sm90 family's
FP8 forward (ops fp8_fwd / fp8_varlen_fwd).

torch.nn.attention.experimental._scaled_dot_product_attention_quantized calls
aten::_scaled_dot_product_flash_attention.quantized; a packed batch reaches
aten::_flash_attention_forward.quantized. Both take float8_e4m3fn q, k, v and
float32 descales of shape (batch, kv heads), and return a bfloat16 output.
The provider's switch (_provider.py) serves them with the provider active or
inside enable(); every call the kernel cannot take goes on to PyTorch's
kernel, with the reason in stats() and the log. Forward only: the ops have no
autograd formula, so PyTorch's own warning and error meet a request for
gradients, as without this package.
"""
import functools

import torch

from . import _router, _stats
from ._checks import broadcast, misaligned
from ._library import align_bytes, built_kernel_set

_ops = torch.ops.torch_flash_backend

FP8 = torch.float8_e4m3fn


def kernel_name(head_dim: int) -> str:
    return f"sm90_fwd_fp8_hdim{head_dim}"


@functools.cache
def _built_head_dims() -> frozenset[int]:
    return frozenset(k.head_dim for k in built_kernel_set() if k.dtype == "fp8" and k.pass_ == "fwd")


def _layout_problem(t: torch.Tensor, name: str, packed: bool) -> str | None:
    """The sm90 family's rule (TMA: its registry align_bytes, no stride 0), as
    _checks states it for every input; metadata only (FakeTensors too)."""
    view = t.unsqueeze(0).transpose(1, 2) if packed else t  # (B, H, L, E)
    if broadcast(view):
        return f"{name} is broadcast with stride 0, which TMA cannot read"
    return misaligned(name, view, align_bytes("sm90"))


def decide(q, k, v, dropout_p=0.0, is_causal=False, *, packed=False, return_debug_mask=False,
           window=(-1, -1), seqused_k=None, alibi_slopes=None) -> "_router.Decision":
    """Whether the FP8 forward serves a quantized flash op's call, or why not.
    Dense calls take (B, H, L, E) tensors, packed ones (total, H, E)."""
    tensors = (q, k, v)
    reason = None
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        reason = "FP8 inputs off CUDA"
    elif any(t.dtype != FP8 for t in tensors):
        reason = f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: the FP8 kernel takes float8_e4m3fn q, k and v"
    elif dropout_p != 0.0:
        reason = "dropout_p > 0 with FP8 inputs is not supported"
    elif return_debug_mask:
        reason = "return_debug_mask=True is not supported"
    elif alibi_slopes is not None:
        reason = "alibi_slopes is not supported"
    elif tuple(window) != (-1, -1):
        reason = "a sliding window with FP8 inputs is not supported"
    elif seqused_k is not None and not packed:
        reason = "seqused_k without cum_seq_q / cum_seq_k is not supported"
    elif q.dim() != (3 if packed else 4) or k.dim() != q.dim() or v.dim() != q.dim():
        reason = f"FP8 inputs must be {'3-D (total, heads, head_dim)' if packed else '4-D'}"
    elif _router._cuda_capability(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
            != (9, 0):
        reason = "FP8 attention runs on compute capability 9.0 (Hopper) alone"
    elif not q.size(-1) == k.size(-1) == v.size(-1):
        reason = "a value head dim unlike the query's with FP8 inputs is not supported"
    elif q.size(-1) not in _built_head_dims():
        reason = f"no FP8 kernel for head dim {q.size(-1)} (built: {sorted(_built_head_dims())})"
    else:
        for t, name in ((q, "query"), (k, "key"), (v, "value")):
            reason = _layout_problem(t, name, packed)
            if reason is not None:
                break
    if reason is not None:
        return _router.Decision(False, None, reason)
    e = q.size(-1)
    detail = f"fp8, head dim {e}" + (", causal" if is_causal else "") + (", packed" if packed else "")
    return _router.Decision(True, kernel_name(e), detail)


def _bf16_like(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """out in the strides of the ops' meta functions (a bfloat16 empty_like of the query)."""
    if out.stride() == ref.stride():
        return out
    return torch.empty_like(ref, dtype=torch.bfloat16).copy_(out)


def _placeholders(query: torch.Tensor):
    seed = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    return seed, offset, torch.empty(0, dtype=torch.bfloat16, device=query.device)


def serve_sdpa(query, key, value, q_descale, k_descale, v_descale, dropout_p=0.0, is_causal=False,
               return_debug_mask=False, scale=None):
    """aten::_scaled_dot_product_flash_attention.quantized by our kernel:
    (its outputs or None, the decision), counted in stats()."""
    decision = decide(query, key, value, dropout_p, is_causal, return_debug_mask=return_debug_mask)
    _stats.count(decision)
    if not decision.served:
        return None, decision
    out, lse = _ops.fp8_fwd(query, key, value, q_descale, k_descale, v_descale, scale, is_causal, True)
    seed, offset, debug_mask = _placeholders(query)
    return (_bf16_like(out, query), lse, None, None, query.size(2), key.size(2), seed, offset, debug_mask), decision


def serve_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                  q_descale, k_descale, v_descale, scale=None, window_size_left=None, window_size_right=None,
                  seqused_k=None, alibi_slopes=None):
    """aten::_flash_attention_forward.quantized ((B, L, H, E) or packed (total,
    H, E) tensors) by our kernel: (its outputs or None, the decision)."""
    packed = cum_seq_q is not None or cum_seq_k is not None
    window = (-1 if window_size_left is None else int(window_size_left),
              -1 if window_size_right is None else int(window_size_right))
    if packed and (cum_seq_q is None or cum_seq_k is None):
        decision = _router.Decision(False, None, "cum_seq_q without cum_seq_k, or the reverse, is not supported")
    else:
        # Dense tensors come as (B, L, H, E); decide() reads (B, H, L, E).
        views = [t.transpose(1, 2) if not packed and isinstance(t, torch.Tensor) and t.dim() == 4 else t
                 for t in (query, key, value)]
        decision = decide(*views, dropout_p, is_causal, packed=packed, return_debug_mask=return_debug_mask,
                          window=window, seqused_k=seqused_k, alibi_slopes=alibi_slopes)
    _stats.count(decision)
    if not decision.served:
        return None, decision
    seed, offset, debug_mask = _placeholders(query)
    if packed:
        out, lse = _ops.fp8_varlen_fwd(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, q_descale, k_descale,
                                       v_descale, scale, is_causal, seqused_k)
        return (_bf16_like(out, query), lse, seed, offset, debug_mask), decision
    out, lse = _ops.fp8_fwd(*views, q_descale, k_descale, v_descale, scale, is_causal, True)
    return (_bf16_like(out.transpose(1, 2), query), lse, seed, offset, debug_mask), decision
