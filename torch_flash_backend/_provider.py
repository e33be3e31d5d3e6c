"""Our kernels as a provider for PyTorch's flash-attention hook.

Importing the package registers the provider; a user switches it on process-wide
with torch.nn.attention.activate_flash_attention_impl("torch_flash_backend") and
off with restore_flash_attention_impl(). Active, it overrides the CUDA kernels of
the aten flash ops: calls ours can serve run our kernels, every other call goes to
the kernel PyTorch had registered before (fetched before overriding).

Outputs take the strides of the ops' meta functions (empty_like of the inputs),
which compiled graphs assert on; that costs a copy only when an input is not in
the (B, L, H, E) memory layout our kernels write.
"""
import dataclasses
import logging
import warnings

import torch
from torch.nn import attention as _attention

from . import _autograd  # noqa: F401  (the ops, fake kernels and autograd)
from . import _router, _stats
from ._checks import kernel_friendly
from ._library import reads_stride0

_ops = torch.ops.torch_flash_backend

logger = logging.getLogger("torch_flash_backend")

NAME = "torch_flash_backend"
_OPS = (
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
)


@dataclasses.dataclass
class ProviderHandle:
    library: torch.library.Library | None

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None
            _forget_dispatch()


def _forget_dispatch() -> None:
    # The Python dispatcher caches each op's kernel per dispatch key.
    for name in _OPS:
        getattr(torch.ops.aten, name).default._dispatch_cache.clear()


def _window(left, right) -> tuple[int, int]:
    """PyTorch's flash ops' window_size_left / right as the ops take them (-1: open)."""
    return (-1 if left is None else int(left), -1 if right is None else int(right))


def _count(decision, backward: bool) -> None:
    """Every call through the hook counts in stats() and logs at DEBUG, as enable()'s do;
    a served backward under the backward kernel's name."""
    if backward and decision.served and decision.backward_kernel:
        decision = dataclasses.replace(decision, kernel=decision.backward_kernel)
    _stats.count(decision)
    op = "flash attention backward" if backward else "flash attention forward"
    if decision.served:
        logger.debug("provider: %s %s", op, decision)
    else:
        logger.debug("provider: %s passed on to PyTorch's kernel: %s", op, decision.reason)


def _unsupported(backward: bool, cum_seq_q=None, cum_seq_k=None, return_debug_mask=False, seqused_k=None,
                 alibi_slopes=None) -> bool:
    """Whether the call asks for a feature our kernels lack (then counted as passed on)."""
    reason = ("variable-length inputs (cum_seq_q / cum_seq_k)" if cum_seq_q is not None or cum_seq_k is not None
              else "return_debug_mask=True" if return_debug_mask
              else "seqused_k" if seqused_k is not None
              else "alibi_slopes" if alibi_slopes is not None
              else None)
    if reason is not None:
        _count(_router.Decision(False, None, f"{reason} is not supported"), backward)
    return reason is not None


def _serves(q, k, v, dropout_p, is_causal, scale, backward: bool, window=(-1, -1)) -> str | None:
    """The kernel family that serves the call (the backward's when backward), or None;
    q, k, v in (B, H, L, E). Counted in stats() and logged as enable()'s
    calls are. PyTorch's flash ops align is_causal and windows bottom-right
    (the ops' bottom_right=True, which the kernels here are given)."""
    if q.dim() != 4 or k.dim() != 4:
        decision = _router.Decision(False, None, "inputs are not 4-D")
    else:
        decision = _router.decide(q, k, v, None, dropout_p, is_causal, scale, True, needs_grad=backward,
                                  bottom_right=True, window=window)
    _count(decision, backward)
    if not decision.served:
        return None
    return decision.backward_family if backward else decision.family


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    if t.stride() == ref.stride():
        return t
    return torch.empty_like(ref).copy_(t)


def _lse_ok(lse: torch.Tensor, q: torch.Tensor) -> bool:
    return lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (q.size(0), q.size(1), q.size(2))


def _rng_placeholders(query: torch.Tensor):
    # Dropout is 0 on every call we serve, so the RNG state is never read; the
    # shapes and dtypes are those of PyTorch's meta functions.
    seed = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    return seed, offset, torch.empty(0, dtype=query.dtype, device=query.device)


def _backward(grad_out, q, k, v, out, lse, scale, is_causal, family, window=(-1, -1)):
    dq, dk, dv = _ops.bwd(kernel_friendly(grad_out, reads_stride0(family)), q, k, v, kernel_friendly(out), lse, scale,
                          is_causal, family, bottom_right=True, window_left=window[0], window_right=window[1])
    return _like(dq, q), _like(dk, k), _like(dv, v)


def _make_kernels(original):
    def flash_attention_forward(keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                                window_size_right=None, seqused_k=None, alibi_slopes=None):
        if not _unsupported(False, cum_seq_q, cum_seq_k, return_debug_mask, seqused_k, alibi_slopes):
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # ours take (B, H, L, E)
            window = _window(window_size_left, window_size_right)
            family = _serves(q, k, v, dropout_p, is_causal, scale, backward=False, window=window)
            if family is not None:
                out, lse = _ops.fwd(q, k, v, scale, is_causal, family, bottom_right=True, window_left=window[0],
                                    window_right=window[1])
                return _like(out.transpose(1, 2), query), lse, *_rng_placeholders(query)
        return original["_flash_attention_forward"].call_boxed(
            keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
            return_debug_mask, scale=scale, window_size_left=window_size_left,
            window_size_right=window_size_right, seqused_k=seqused_k, alibi_slopes=alibi_slopes)

    def flash_attention_backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                 max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                                 window_size_left=None, window_size_right=None):
        if not _unsupported(True, cum_seq_q, cum_seq_k):
            q, k, v, go, o = (t.transpose(1, 2) for t in (query, key, value, grad_out, out))
            window = _window(window_size_left, window_size_right)
            family = (_serves(q, k, v, dropout_p, is_causal, scale, backward=True, window=window)
                      if _lse_ok(logsumexp, q) else None)
            if family is not None:
                dq, dk, dv = _backward(go, q, k, v, o, logsumexp, scale, is_causal, family, window)
                return _like(dq.transpose(1, 2), query), _like(dk.transpose(1, 2), key), _like(dv.transpose(1, 2), value)
        return original["_flash_attention_backward"].call_boxed(
            keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
            is_causal, rng_state, unused, scale=scale, window_size_left=window_size_left,
            window_size_right=window_size_right)

    def sdpa_flash(keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                   scale=None):
        family = (None if _unsupported(False, return_debug_mask=return_debug_mask)
                  else _serves(query, key, value, dropout_p, is_causal, scale, backward=False))
        if family is not None:
            out, lse = _ops.fwd(query, key, value, scale, is_causal, family, bottom_right=True)
            seed, offset, debug_mask = _rng_placeholders(query)
            return _like(out, query), lse, None, None, query.size(2), key.size(2), seed, offset, debug_mask
        return original["_scaled_dot_product_flash_attention"].call_boxed(
            keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)

    def sdpa_flash_backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                            max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        family = (None if _unsupported(True, cum_seq_q, cum_seq_k) or not _lse_ok(logsumexp, query)
                  else _serves(query, key, value, dropout_p, is_causal, scale, backward=True))
        if family is not None:
            return _backward(grad_out, query, key, value, out, logsumexp, scale, is_causal, family)
        return original["_scaled_dot_product_flash_attention_backward"].call_boxed(
            keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
            is_causal, philox_seed, philox_offset, scale=scale)

    return {
        "_flash_attention_forward": flash_attention_forward,
        "_flash_attention_backward": flash_attention_backward,
        "_scaled_dot_product_flash_attention": sdpa_flash,
        "_scaled_dot_product_flash_attention_backward": sdpa_flash_backward,
    }


def register() -> ProviderHandle:
    """The register_fn PyTorch calls on activate_flash_attention_impl(NAME)."""
    original = {name: torch.library.get_kernel(f"aten::{name}", "CUDA") for name in _OPS}
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    with warnings.catch_warnings():
        # Overriding PyTorch's kernels is the point; the dispatcher warns about it once.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for name, kernel in _make_kernels(original).items():
            lib.impl(name, kernel, "CUDA", with_keyset=True)
    _forget_dispatch()
    return ProviderHandle(lib)


if hasattr(_attention, "register_flash_attention_impl"):
    _attention.register_flash_attention_impl(NAME, register_fn=register)
