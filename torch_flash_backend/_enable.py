"""enable(): routes the SDPA calls made in this thread to our ops.

Routing sits in the dispatcher, not in Python: the op library gives
aten::scaled_dot_product_attention a kernel at the autograd and backend keys of
CPU and CUDA (csrc/routing.cpp), registered once when it loads. Outside enable()
that kernel calls PyTorch's own (CompositeImplicitAutograd) kernel; inside, it
calls torch_flash_backend::route_sdpa, whose Python kernel below decides. That
also catches the calls made from C++ (nn.MultiheadAttention and
nn.TransformerEncoderLayer fast paths). enable() itself only pushes onto a
thread-local stack, so any number of threads may enter and leave it while others
run SDPA. torch.compile and torch.export: see _Routing.
"""
import functools
import logging
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _router, _stats
from . import _autograd  # noqa: F401  (the ops, fake kernels and autograd)

_ops = torch.ops.torch_flash_backend

logger = logging.getLogger("torch_flash_backend")

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


class UnsupportedError(RuntimeError):
    """Raised under enable(strict=True) for an SDPA call our kernels cannot serve."""

    def __init__(self, reason: str):
        super().__init__(f"torch_flash_backend cannot serve this scaled_dot_product_attention call: {reason}")
        self.reason = reason


class _Routing(TorchFunctionMode):
    """Dynamo guards on the torch-function-mode stack, so having this mode on it
    makes a function compiled inside enable() recompile when called outside (and
    vice versa), without guarding on anything per call.

    It passes every call through but SDPA's where the dispatcher-level switch
    cannot see it: Dynamo traces this mode (also when enable() is entered inside
    the compiled function), so there it emits route_sdpa, decided when
    AOTAutograd traces the graph; torch.export keeps
    aten::scaled_dot_product_attention whole in its graphs, so an SDPA call
    traced for export is decided here.
    """

    strict = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            # torch.export(strict=True) traces with Dynamo too, and would keep
            # route_sdpa whole: its SDPA call goes on to the dispatcher-level switch.
            if torch.compiler.is_dynamo_compiling() and not _exporting():
                return _route_op(*args, strict=self.strict, **kwargs)
            if _exporting() and not torch.compiler.is_dynamo_compiling():
                return _route_for_export(func, args, kwargs, self.strict)
        return func(*args, **kwargs)


class _StrictRouting(_Routing):
    # A distinct type, so that switching strictness also recompiles.
    strict = True


def _exporting() -> bool:
    # Dynamo answers True to torch.compiler.is_exporting() whenever it traces;
    # the flag behind it tells torch.export from torch.compile.
    return getattr(torch.compiler, "_is_exporting_flag", False)


def _route_op(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              *, strict):
    return _ops.route_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, strict)


_local = threading.local()


def _modes() -> list:
    modes = getattr(_local, "modes", None)
    if modes is None:
        modes = _local.modes = []
    return modes


def _route(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, strict, fallback):
    decision = _router.decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    _stats.count(decision)
    if decision.served:
        logger.debug("scaled_dot_product_attention %s", decision)
        return _ops.fwd(q, k, v, scale, is_causal, decision.family, decision.backward_family)[0]
    if strict:
        raise UnsupportedError(decision.reason)
    logger.debug("scaled_dot_product_attention falls back to PyTorch SDPA: %s", decision.reason)
    return fallback()


def _route_for_export(func, args, kwargs, strict):
    def call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return _route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, strict, fallback)

    def fallback():
        _local.decided = True  # the dispatcher-level kernel must not decide (and count) again
        try:
            return func(*args, **kwargs)
        finally:
            _local.decided = False

    return call(*args, **kwargs)


def _pytorch_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return _SDPA.decompose(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _route_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                strict=False):
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if getattr(_local, "decided", False):
        return _pytorch_sdpa(*args)
    return _route(*args, strict, fallback=lambda: _pytorch_sdpa(*args))


# The decision, as route_sdpa's kernel: reached from csrc/routing.cpp in eager
# code and from compiled graphs (_Routing), on every device and autograd key.
_library = torch.library.Library("torch_flash_backend", "IMPL")  # noqa: TOR901
_library.impl("route_sdpa", _route_sdpa, "CompositeImplicitAutograd")
# The Python dispatcher caches which kernel serves each key of an op; the
# library's own kernels for SDPA arrived when it loaded.
_SDPA._dispatch_cache.clear()

_active_lock = threading.Lock()
_active = 0  # enable() blocks entered and not yet left, over all threads


def is_active() -> bool:
    """Whether some thread is inside enable() (eager)."""
    return _active > 0


def _count_active(delta: int) -> None:
    global _active
    with _active_lock:
        _active += delta


class enable:
    """Routes this thread's scaled_dot_product_attention calls to our kernels.

    A context manager and a decorator; nestable (the innermost strict setting
    applies) and thread-local. Calls that cannot be served run PyTorch's own SDPA
    (a DEBUG line on the "torch_flash_backend" logger gives the reason), or raise
    UnsupportedError when strict=True. Also inside a function compiled with
    torch.compile(fullgraph=True), as a with-statement or a decorator.

    A function compiled outside enable() is recompiled when called inside it,
    and vice versa, never per call.
    """

    def __init__(self, strict: bool = False):
        self.strict = bool(strict)

    def __call__(self, fn):
        # A fresh context manager per call, made inside the decorated function:
        # Dynamo enters only context managers created inside the compiled region.
        strict = self.strict

        @functools.wraps(fn)
        def routed(*args, **kwargs):
            with enable(strict=strict):
                return fn(*args, **kwargs)

        return routed

    def __enter__(self):
        mode = _StrictRouting() if self.strict else _Routing()
        if torch.compiler.is_dynamo_compiling():
            mode.__enter__()  # traced: the mode routes the graph's SDPA calls
            return self
        mode.__enter__()
        try:
            _ops.routing_push(self.strict)
        except BaseException:
            mode.__exit__(None, None, None)
            raise
        _modes().append(mode)
        _count_active(1)
        return self

    def __exit__(self, *exc_info):
        if torch.compiler.is_dynamo_compiling():
            # TorchFunctionMode.__exit__ pops the innermost mode and reads
            # nothing of its instance; the traced __enter__ kept none.
            _Routing.__exit__(None, *exc_info)
            return False
        mode = _modes().pop()
        _count_active(-1)
        try:
            _ops.routing_pop()
        finally:
            mode.__exit__(*exc_info)
        return False


def explain(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Whether enable() would serve this SDPA call, by which kernel, or why not.

    The result prints as "served by <kernel> (...)" or "falls back to PyTorch
    SDPA: <reason>", and has .served, .kernel and .reason.
    """
    return _router.decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
