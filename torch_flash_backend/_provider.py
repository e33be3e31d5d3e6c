"""Our kernels for PyTorch's flash ops: the provider for PyTorch's
flash-attention hook, and enable()'s switch for packed batches.

Importing the package registers the provider; a user switches it on process-wide
with torch.nn.attention.activate_flash_attention_impl("torch_flash_backend") and
off with restore_flash_attention_impl(). Active, it serves the CUDA calls of the
aten flash ops: calls ours can serve run our kernels, every other call goes to
the kernel PyTorch had registered before (fetched before overriding).

Packed variable-length batches (torch.nn.attention.varlen.varlen_attn, SDPA on
nested jagged tensors) reach no SDPA op: both call _flash_attention_forward /
_backward with cum_seq_q / cum_seq_k. So the package puts a switch in front of
PyTorch's CUDA kernels of those two ops when it loads: with the provider
active, the provider's kernels serve; else, inside enable(), a packed forward
runs ours (or PyTorch's, or raises under strict=True), as does the backward of
a forward ours served, wherever autograd runs it; every other call goes on to
PyTorch's kernel (one Python call on the way, a few microseconds). The provider
overrides the other two ops (the SDPA flash ops) itself. The switch also
fronts the FP8 (.quantized) overloads of _flash_attention_forward and
_scaled_dot_product_flash_attention, which _fp8.py serves with the provider
active or inside enable(). Packed calls that pass through autograd meet
enable() earlier, at AutogradCUDA (_install_autograd_routes), which is also
where a compiled graph's trace sees them.

Outputs take the strides of the ops' meta functions (empty_like of the inputs),
which compiled graphs assert on; that costs a copy only when an input is not in
the (B, L, H, E) memory layout our kernels write.
"""
import contextlib
import dataclasses
import logging
import threading
import warnings

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn import attention as _attention

from . import _autograd  # noqa: F401  (the ops, fake kernels and autograd)
from . import _fp8, _router, _stats
from ._checks import kernel_friendly, unbacked
from ._library import reads_stride0

_ops = torch.ops.torch_flash_backend

logger = logging.getLogger("torch_flash_backend")

NAME = "torch_flash_backend"
# The switch's ops (from import on), then the ops the provider overrides when active.
_SWITCH_OPS = ("_flash_attention_forward", "_flash_attention_backward")
_OPS = _SWITCH_OPS + ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")
# Their FP8 overloads (_fp8.py), switched from import on as well.
_QUANTIZED_OPS = ("_flash_attention_forward", "_scaled_dot_product_flash_attention")

_active_handles = 0  # provider handles registered and not yet removed


def active() -> bool:
    """Whether the provider hook is on (the switch then runs its kernels)."""
    return _active_handles > 0


@dataclasses.dataclass
class ProviderHandle:
    library: torch.library.Library | None

    def remove(self) -> None:
        global _active_handles
        if self.library is not None:
            self.library._destroy()
            self.library = None
            _active_handles -= 1
            _forget_dispatch()


def _forget_dispatch() -> None:
    # The Python dispatcher caches each op's kernel per dispatch key.
    for name in _OPS:
        getattr(torch.ops.aten, name).default._dispatch_cache.clear()
    for name in _QUANTIZED_OPS:
        getattr(torch.ops.aten, name).quantized._dispatch_cache.clear()


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


def _feature_reason(return_debug_mask=False, seqused_k=None, alibi_slopes=None, packed=False) -> str | None:
    """A feature the call asks for that our kernels lack, or None."""
    reason = ("return_debug_mask=True" if return_debug_mask
              else "seqused_k without cum_seq_q / cum_seq_k" if seqused_k is not None and not packed
              else "alibi_slopes" if alibi_slopes is not None
              else None)
    return None if reason is None else f"{reason} is not supported"


def _unsupported(backward: bool, return_debug_mask=False, seqused_k=None, alibi_slopes=None) -> bool:
    """Whether the call asks for a feature our kernels lack (then counted as passed on)."""
    reason = _feature_reason(return_debug_mask, seqused_k, alibi_slopes)
    if reason is not None:
        _count(_router.Decision(False, None, reason), backward)
    return reason is not None


# The storages of the logsumexps our packed forwards returned, weakly (by
# their StorageImpl, which no other storage takes while a weak reference
# holds it): a packed backward the switch meets outside enable() (autograd
# runs it later, on its own threads) still runs ours when its forward did.
_served_lse: dict[int, StorageWeakRef] = {}
_served_lse_limit = 128
_served_lse_lock = threading.Lock()  # forwards add from any thread while others prune


def _remember_served(lse: torch.Tensor) -> None:
    global _served_lse_limit
    if type(lse) is not torch.Tensor:  # FakeTensors and traced tensors have no storage to remember
        return
    storage = lse.untyped_storage()
    with _served_lse_lock:
        _served_lse[storage._cdata] = StorageWeakRef(storage)
        if len(_served_lse) > _served_lse_limit:
            for key in [key for key, ref in _served_lse.items() if ref.expired()]:
                del _served_lse[key]
            _served_lse_limit = max(128, 2 * len(_served_lse))


def served_forward_of(lse: torch.Tensor) -> bool:
    """Whether lse is (a view of) the logsumexp one of our packed forwards returned."""
    if type(lse) is not torch.Tensor:
        return False
    ref = _served_lse.get(lse.untyped_storage()._cdata)
    return ref is not None and not ref.expired()


def serve_packed_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                         return_debug_mask, scale=None, window_size_left=None, window_size_right=None,
                         seqused_k=None, alibi_slopes=None, pinned=False, autograd=False):
    """PyTorch's flash forward on a packed batch (cum_seq_q / cum_seq_k; (total,
    H, E) tensors, causal and windows bottom-right per sequence) by our kernels:
    (the op's outputs or None, the decision), counted in stats() and logged.
    pinned: any family that can (strict enable()), not only where ours are faster.
    autograd: called above autograd (_install_autograd_routes), so varlen_fwd's
    own autograd runs our backward, decided and counted here with the forward
    (a refusal is counted by the route: _passing_on)."""
    reason = _feature_reason(return_debug_mask, seqused_k, alibi_slopes, packed=True)
    if reason is None and unbacked(max_q, max_k, *query.shape, *key.shape):
        # A data-dependent length (an .item() in the graph) cannot be compared at
        # all; backed symbolic lengths (nested jagged tensors' in a compiled graph)
        # are decided without a guard (_router.decide_varlen) and passed through.
        reason = "data-dependent sequence lengths (a compiled graph with unbacked sizes)"
    window = _window(window_size_left, window_size_right)
    decision = (_router.Decision(False, None, reason) if reason is not None else
                _router.decide_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                      scale, window, seqused_k, needs_grad=None if autograd else False,
                                      pinned=pinned))
    if decision.served or not autograd:  # a route's refusal: counted by _passing_on
        _count(decision, False)
        _passed_on.pending = False
    if not decision.served:
        return None, decision
    if autograd and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        _count(decision, True)  # its backward is decided here too (the counts' rule, _stats.py)
    out, lse = _ops.varlen_fwd(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, scale, is_causal,
                               decision.family, decision.backward_family if autograd else None, window[0],
                               window[1], seqused_k)
    _remember_served(lse)  # a backward reaching the switch runs ours
    return (_like(out, query), lse, *_rng_placeholders(query)), decision


# A packed call an autograd route passes on reaches the switch below PyTorch's
# autograd kernel, which decides it again: it counts once, the deciding switch's
# decision, or the route's where nothing below decides (a compiled graph's trace).
_passed_on = threading.local()


@contextlib.contextmanager
def _passing_on(decision):
    _passed_on.pending = True
    try:
        yield
    finally:
        if getattr(_passed_on, "pending", False):
            _count(decision, False)
        _passed_on.pending = False


def serve_packed_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                          dropout_p, is_causal, scale=None, window_size_left=None, window_size_right=None):
    """PyTorch's flash backward on a packed batch by our kernels: (dq, dk, dv)
    or None, and the decision; counted in stats() and logged. The backward of
    a forward ours served takes any family that can (as the forward did)."""
    window = _window(window_size_left, window_size_right)
    if not _packed_lse_ok(logsumexp, query):
        decision = _router.Decision(False, None, "logsumexp is not a contiguous float32 (heads, total tokens) "
                                                 "tensor")
    else:
        decision = _router.decide_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                         is_causal, scale, window, needs_grad=True,
                                         pinned=served_forward_of(logsumexp))
    _count(decision, True)
    if not decision.served:
        return None, decision
    family = decision.backward_family
    stride0_ok = reads_stride0(family)
    dq, dk, dv = _ops.varlen_bwd(_packed_friendly(grad_out, stride0_ok), query, key, value,
                                 _packed_friendly(out, stride0_ok), logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                 scale, is_causal, family, window[0], window[1], None)
    return (_like(dq, query), _like(dk, key), _like(dv, value)), decision


def _serves(q, k, v, dropout_p, is_causal, scale, backward: bool, window=(-1, -1)) -> str | None:
    """The kernel family that serves the call (the backward's when backward), or None;
    q, k, v in (B, H, L, E). Counted in stats() and logged as enable()'s
    calls are. PyTorch's flash ops align is_causal and windows bottom-right
    (the ops' bottom_right=True, which the kernels here are given)."""
    if q.dim() != 4 or k.dim() != 4:
        decision = _router.Decision(False, None, "inputs are not 4-D")
    else:
        # A forward with dropout is served only where its backward is too: the
        # mask it draws is ours alone to regenerate.
        decision = _router.decide(q, k, v, None, dropout_p, is_causal, scale, True,
                                  needs_grad=backward or dropout_p != 0.0, bottom_right=True, window=window)
    _count(decision, backward)
    if not decision.served:
        return None
    return decision.backward_family if backward else decision.family


def _packed_friendly(t: torch.Tensor, stride0_ok: bool) -> torch.Tensor:
    """kernel_friendly for a packed (total, H, E) tensor."""
    return kernel_friendly(t.unsqueeze(0).transpose(1, 2), stride0_ok).transpose(1, 2).squeeze(0)


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    if t.stride() == ref.stride():
        return t
    return torch.empty_like(ref).copy_(t)


def _lse_ok(lse: torch.Tensor, q: torch.Tensor) -> bool:
    return lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (q.size(0), q.size(1), q.size(2))


def _packed_lse_ok(lse: torch.Tensor, q: torch.Tensor) -> bool:
    return lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (q.size(1), q.size(0))


def _rng_placeholders(query: torch.Tensor):
    # A call without dropout reads no RNG state; the shapes and dtypes are
    # those of PyTorch's meta functions.
    seed = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    return seed, offset, torch.empty(0, dtype=query.dtype, device=query.device)


def _forward(q, k, v, dropout_p, scale, is_causal, family, return_debug_mask, window=(-1, -1)):
    """(out, lse, seed, offset, debug mask) as PyTorch's flash forward gives them,
    q, k, v in (B, H, L, E). With dropout, `seed` is the op's rng_state (seed,
    offset) as PyTorch's kernel packs it, and lse is remembered: the backward
    regenerates our mask only for a forward of ours (served_forward_of)."""
    if dropout_p == 0.0:
        out, lse = _ops.fwd(q, k, v, scale, is_causal, family, bottom_right=True, window_left=window[0],
                            window_right=window[1])
        return (out, lse, *_rng_placeholders(q))
    out, lse, rng_state = _ops.dropout_fwd(q, k, v, float(dropout_p), scale, is_causal, family, None,
                                           bottom_right=True, window_left=window[0], window_right=window[1])
    _remember_served(lse)
    _, offset, debug = _rng_placeholders(q)
    if return_debug_mask:
        # PyTorch's encoding: a pair's entry is negative where dropout dropped it.
        kept = _ops.dropout_mask(rng_state, float(dropout_p), q.size(0), q.size(1), q.size(2), k.size(2))
        debug = torch.where(kept, 1.0, -1.0).to(q.dtype)
    return out, lse, rng_state.view(torch.uint64), offset, debug


def _backward(grad_out, q, k, v, out, lse, scale, is_causal, family, window=(-1, -1), dropout_p=0.0, rng_state=None):
    extra = dict(bottom_right=True, window_left=window[0], window_right=window[1])
    grad_out = kernel_friendly(grad_out, reads_stride0(family))
    if dropout_p == 0.0:
        dq, dk, dv = _ops.bwd(grad_out, q, k, v, kernel_friendly(out), lse, scale, is_causal, family, **extra)
    else:
        dq, dk, dv = _ops.dropout_bwd(grad_out, q, k, v, kernel_friendly(out), lse, rng_state.view(torch.int64),
                                      float(dropout_p), scale, is_causal, family, **extra)
    return _like(dq, q), _like(dk, k), _like(dv, v)


def _dropout_backward_ok(dropout_p, lse) -> bool:
    """A backward with dropout regenerates the forward's mask: ours only after a
    forward of ours (PyTorch's kernel draws its own)."""
    return dropout_p == 0.0 or served_forward_of(lse)


def _check_dropout_passed_on(dropout_p, lse) -> None:
    """PyTorch's backward cannot regenerate our forward's dropout mask."""
    if dropout_p != 0.0 and served_forward_of(lse):
        raise RuntimeError("torch_flash_backend: this flash attention backward with dropout follows a forward our "
                           "kernels served, and none of ours serves it now (TFB_KERNEL_FAMILIES or the provider "
                           "changed in between?); PyTorch's kernel would draw another mask")


def _make_kernels(original):
    def flash_attention_forward(keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                                window_size_right=None, seqused_k=None, alibi_slopes=None):
        packed = cum_seq_q is not None or cum_seq_k is not None
        if packed:
            outputs, _ = serve_packed_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                              is_causal, return_debug_mask, scale, window_size_left,
                                              window_size_right, seqused_k, alibi_slopes)
            if outputs is not None:
                return outputs
        elif not _unsupported(False, return_debug_mask and dropout_p == 0.0, seqused_k, alibi_slopes):
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # ours take (B, H, L, E)
            window = _window(window_size_left, window_size_right)
            family = _serves(q, k, v, dropout_p, is_causal, scale, backward=False, window=window)
            if family is not None:
                out, lse, *rest = _forward(q, k, v, dropout_p, scale, is_causal, family, return_debug_mask, window)
                return _like(out.transpose(1, 2), query), lse, *rest
        return original["_flash_attention_forward"].call_boxed(
            keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
            return_debug_mask, scale=scale, window_size_left=window_size_left,
            window_size_right=window_size_right, seqused_k=seqused_k, alibi_slopes=alibi_slopes)

    def flash_attention_backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                 max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                                 window_size_left=None, window_size_right=None):
        window = _window(window_size_left, window_size_right)
        if cum_seq_q is not None or cum_seq_k is not None:
            grads, _ = serve_packed_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                                             max_k, dropout_p, is_causal, scale, window_size_left, window_size_right)
            if grads is not None:
                return grads
        else:
            q, k, v, go, o = (t.transpose(1, 2) for t in (query, key, value, grad_out, out))
            family = (_serves(q, k, v, dropout_p, is_causal, scale, backward=True, window=window)
                      if _lse_ok(logsumexp, q) and _dropout_backward_ok(dropout_p, logsumexp) else None)
            if family is not None:
                dq, dk, dv = _backward(go, q, k, v, o, logsumexp, scale, is_causal, family, window, dropout_p,
                                       rng_state)
                return _like(dq.transpose(1, 2), query), _like(dk.transpose(1, 2), key), _like(dv.transpose(1, 2), value)
        _check_dropout_passed_on(dropout_p, logsumexp)
        return original["_flash_attention_backward"].call_boxed(
            keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
            is_causal, rng_state, unused, scale=scale, window_size_left=window_size_left,
            window_size_right=window_size_right)

    def sdpa_flash(keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                   scale=None):
        family = (None if _unsupported(False, return_debug_mask=return_debug_mask and dropout_p == 0.0)
                  else _serves(query, key, value, dropout_p, is_causal, scale, backward=False))
        if family is not None:
            out, lse, seed, offset, debug_mask = _forward(query, key, value, dropout_p, scale, is_causal, family,
                                                          return_debug_mask)
            return _like(out, query), lse, None, None, query.size(2), key.size(2), seed, offset, debug_mask
        return original["_scaled_dot_product_flash_attention"].call_boxed(
            keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)

    def sdpa_flash_backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                            max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        packed = cum_seq_q is not None or cum_seq_k is not None  # never from PyTorch's SDPA; passed on
        family = (None if packed or not _lse_ok(logsumexp, query) or not _dropout_backward_ok(dropout_p, logsumexp)
                  else _serves(query, key, value, dropout_p, is_causal, scale, backward=True))
        if family is not None:
            return _backward(grad_out, query, key, value, out, logsumexp, scale, is_causal, family,
                             dropout_p=dropout_p, rng_state=philox_seed)
        _check_dropout_passed_on(dropout_p, logsumexp)
        return original["_scaled_dot_product_flash_attention_backward"].call_boxed(
            keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
            is_causal, philox_seed, philox_offset, scale=scale)

    return {
        "_flash_attention_forward": flash_attention_forward,
        "_flash_attention_backward": flash_attention_backward,
        "_scaled_dot_product_flash_attention": sdpa_flash,
        "_scaled_dot_product_flash_attention_backward": sdpa_flash_backward,
    }


def _install_switch() -> torch.library.Library:
    """The switch in front of PyTorch's kernels of _SWITCH_OPS (the module's docstring)."""
    pytorch = {name: torch.library.get_kernel(f"aten::{name}", "CUDA") for name in _SWITCH_OPS}
    provider = _make_kernels(pytorch)

    def forward(keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                alibi_slopes=None):
        kwargs = dict(scale=scale, window_size_left=window_size_left, window_size_right=window_size_right,
                      seqused_k=seqused_k, alibi_slopes=alibi_slopes)
        args = (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask)
        if active():
            return provider["_flash_attention_forward"](keyset, *args, **kwargs)
        if cum_seq_q is not None or cum_seq_k is not None:
            from . import _enable  # imports this module
            strict = _enable.routing_strictness()
            if strict is not None:
                outputs, decision = serve_packed_forward(*args, **kwargs, pinned=strict)
                if outputs is not None:
                    return outputs
                if strict:
                    raise _enable.UnsupportedError(decision.reason)
        return pytorch["_flash_attention_forward"].call_boxed(keyset, *args, **kwargs)

    def backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                 dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                 window_size_right=None):
        kwargs = dict(scale=scale, window_size_left=window_size_left, window_size_right=window_size_right)
        args = (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                is_causal)
        if active():
            return provider["_flash_attention_backward"](keyset, *args, rng_state, unused, **kwargs)
        if (cum_seq_q is not None or cum_seq_k is not None) and served_forward_of(logsumexp):
            grads, _ = serve_packed_backward(*args, **kwargs)
            if grads is not None:
                return grads
        return pytorch["_flash_attention_backward"].call_boxed(keyset, *args, rng_state, unused, **kwargs)

    quantized = {name: torch.library.get_kernel(f"aten::{name}.quantized", "CUDA") for name in _QUANTIZED_OPS}

    def fp8(serve, name):
        # With the provider active, or inside enable(): the FP8 kernel where it can (strict: or raise).
        def kernel(keyset, *args, **kwargs):
            from . import _enable  # imports this module
            strict = None if active() else _enable.routing_strictness()
            if active() or strict is not None:
                outputs, decision = serve(*args, **kwargs)
                if outputs is not None:
                    return outputs
                if strict:
                    raise _enable.UnsupportedError(decision.reason)
            return quantized[name].call_boxed(keyset, *args, **kwargs)
        return kernel

    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    with warnings.catch_warnings():
        # Overriding PyTorch's kernels is the point; the dispatcher warns about it once.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        lib.impl("_flash_attention_forward", forward, "CUDA", with_keyset=True)
        lib.impl("_flash_attention_backward", backward, "CUDA", with_keyset=True)
        lib.impl("_flash_attention_forward.quantized", fp8(_fp8.serve_forward, "_flash_attention_forward"), "CUDA",
                 with_keyset=True)
        lib.impl("_scaled_dot_product_flash_attention.quantized",
                 fp8(_fp8.serve_sdpa, "_scaled_dot_product_flash_attention"), "CUDA", with_keyset=True)
    _forget_dispatch()
    return lib


_switch = _install_switch()


def _install_autograd_routes() -> tuple[torch.library.Library, torch.library.Library]:
    """enable()'s packed routing above autograd, for compiled graphs.

    A compiled graph runs with autocast off (AOTAutograd bakes autocast into
    the graph and disables it around the graph's run), so enable()'s mark is
    out of the switch's sight when the graph's ops execute. These kernels sit
    at AutogradCUDA, where AOTAutograd's trace meets them with the mark on: a
    packed call enable() serves becomes varlen_fwd in the graph (its backward
    varlen_bwd), decided once at trace time; a graph traced outside enable()
    keeps PyTorch's op. Eager calls inside enable() take the same path; with
    the provider active, or outside enable(), PyTorch's autograd kernel runs.
    Covers varlen_attn (its custom op, opaque to the trace) and
    _flash_attention_forward (SDPA on nested jagged tensors)."""
    from torch.nn.attention import varlen  # noqa: F401  (defines torch_attn::_varlen_attn)

    varlen_original = torch.library.get_kernel("torch_attn::_varlen_attn", "AutogradCUDA")
    flash_original = torch.library.get_kernel("aten::_flash_attention_forward", "AutogradCUDA")

    def strictness():
        from . import _enable  # imports this module
        return None if active() else _enable.routing_strictness()

    def unsupported(decision):  # counted, as a call strict mode refuses is
        from . import _enable
        _count(decision, False)
        return _enable.UnsupportedError(decision.reason)

    def varlen_attn(keyset, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                    window_size=None):
        strict = strictness()
        if strict is not None:
            left, right = (None, None) if window_size is None else window_size
            outputs, decision = serve_packed_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0,
                                                     is_causal, False, scale, left, right, pinned=strict,
                                                     autograd=True)
            if outputs is not None:
                return outputs[0], outputs[1], outputs[2]  # out, lse, rng_state as varlen_attn's op gives them
            if strict:
                raise unsupported(decision)
            with _passing_on(decision):
                return varlen_original.call_boxed(keyset, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                                  is_causal, scale, window_size)
        return varlen_original.call_boxed(keyset, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                                          scale, window_size)

    def flash_forward(keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                      return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                      seqused_k=None, alibi_slopes=None):
        kwargs = dict(scale=scale, window_size_left=window_size_left, window_size_right=window_size_right,
                      seqused_k=seqused_k, alibi_slopes=alibi_slopes)
        strict = strictness() if cum_seq_q is not None or cum_seq_k is not None else None
        if strict is not None:
            outputs, decision = serve_packed_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                                     dropout_p, is_causal, return_debug_mask, **kwargs,
                                                     pinned=strict, autograd=True)
            if outputs is not None:
                return outputs
            if strict:
                raise unsupported(decision)
            with _passing_on(decision):
                return flash_original.call_boxed(keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                                 dropout_p, is_causal, return_debug_mask, **kwargs)
        return flash_original.call_boxed(keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                         is_causal, return_debug_mask, **kwargs)

    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    varlen_lib = torch.library.Library("torch_attn", "IMPL")  # noqa: TOR901
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        lib.impl("_flash_attention_forward", flash_forward, "AutogradCUDA", with_keyset=True)
        varlen_lib.impl("_varlen_attn", varlen_attn, "AutogradCUDA", with_keyset=True)
    torch.ops.aten._flash_attention_forward.default._dispatch_cache.clear()
    torch.ops.torch_attn._varlen_attn.default._dispatch_cache.clear()
    return lib, varlen_lib


_autograd_routes = _install_autograd_routes()


def register() -> ProviderHandle:
    """The register_fn PyTorch calls on activate_flash_attention_impl(NAME):
    overrides the SDPA flash ops, and turns the switch's ops to the provider."""
    global _active_handles
    sdpa_ops = _OPS[len(_SWITCH_OPS):]
    original = {name: torch.library.get_kernel(f"aten::{name}", "CUDA") for name in sdpa_ops}
    kernels = _make_kernels(original)
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    with warnings.catch_warnings():
        # Overriding PyTorch's kernels is the point; the dispatcher warns about it once.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for name in sdpa_ops:
            lib.impl(name, kernels[name], "CUDA", with_keyset=True)
    _active_handles += 1
    _forget_dispatch()
    return ProviderHandle(lib)


if hasattr(_attention, "register_flash_attention_impl"):
    _attention.register_flash_attention_impl(NAME, register_fn=register)
