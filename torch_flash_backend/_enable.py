"""enable(): routes the SDPA calls made in this thread to our ops.

Routing sits in the dispatcher, not in Python: while any thread is inside
enable(), a Python kernel overrides aten::scaled_dot_product_attention at the
autograd and backend keys of CPU and CUDA. That also catches the calls made from
C++ (nn.MultiheadAttention and nn.TransformerEncoderLayer fast paths) and the
calls torch.compile traces with FakeTensors, so its graphs hold
torch_flash_backend::fwd (torch.export: see _Routing). Threads outside enable() get exactly what PyTorch
would have run: the op's CompositeImplicitAutograd kernel.
"""
import contextlib
import logging
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _router, _stats
from .ops import _ops

logger = logging.getLogger("torch_flash_backend")

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
# Autograd keys see every call outside torch.inference_mode(); the backend keys
# see the calls made inside it, which skip autograd.
_DISPATCH_KEYS = ("AutogradCPU", "AutogradCUDA", "CPU", "CUDA")


class UnsupportedError(RuntimeError):
    """Raised under enable(strict=True) for an SDPA call our kernels cannot serve."""

    def __init__(self, reason: str):
        super().__init__(f"torch_flash_backend cannot serve this scaled_dot_product_attention call: {reason}")
        self.reason = reason


class _Routing(TorchFunctionMode):
    """Dynamo guards on the torch-function-mode stack, so having this mode on it
    makes a function compiled inside enable() recompile when called outside (and
    vice versa), without guarding on anything per call.

    It passes every call through but one: torch.export keeps
    aten::scaled_dot_product_attention whole in its graphs (it never reaches the
    dispatcher-level kernel), so an SDPA call traced for export is routed here.
    """

    strict = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _exporting():
            return _route_for_export(func, args, kwargs)
        return func(*args, **kwargs)


class _StrictRouting(_Routing):
    # A distinct type, so that switching strictness also recompiles.
    strict = True


def _exporting() -> bool:
    # Under torch.compile, Dynamo traces this mode; its calls are routed later,
    # in the dispatcher, where the graph's backward is traced as well.
    return torch.compiler.is_exporting() and not torch.compiler.is_dynamo_compiling()


_local = threading.local()


def _modes() -> list:
    modes = getattr(_local, "modes", None)
    if modes is None:
        modes = _local.modes = []
    return modes


def _route(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, fallback):
    decision = _router.decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    _stats.count(decision)
    if decision.served:
        logger.debug("scaled_dot_product_attention %s", decision)
        return _ops.fwd(q, k, v, scale, is_causal)[0]
    if _local.modes[-1].strict:
        raise UnsupportedError(decision.reason)
    logger.debug("scaled_dot_product_attention falls back to PyTorch SDPA: %s", decision.reason)
    return fallback()


def _route_for_export(func, args, kwargs):
    def call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return _route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, fallback)

    def fallback():
        _local.decided = True  # the dispatcher-level kernel must not decide (and count) again
        try:
            return func(*args, **kwargs)
        finally:
            _local.decided = False

    return call(*args, **kwargs)


def _pytorch_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return _SDPA.decompose(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _sdpa_kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    args = (q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if not getattr(_local, "modes", None) or getattr(_local, "decided", False):
        return _pytorch_sdpa(*args)
    return _route(*args, fallback=lambda: _pytorch_sdpa(*args))


def _forget_dispatch() -> None:
    # The Python dispatcher (used when torch.compile traces) caches which kernel
    # serves each dispatch key of an op; it must see our kernel come and go.
    _SDPA._dispatch_cache.clear()


_install_lock = threading.Lock()
_users = 0
_library: torch.library.Library | None = None


def _acquire() -> None:
    global _users, _library
    with _install_lock:
        if _users == 0:
            lib = torch.library.Library("aten", "IMPL")
            for key in _DISPATCH_KEYS:
                lib.impl("scaled_dot_product_attention", _sdpa_kernel, key)
            _library = lib
            _forget_dispatch()
        _users += 1


def _release() -> None:
    global _users, _library
    with _install_lock:
        _users -= 1
        if _users == 0:
            _library._destroy()
            _library = None
            _forget_dispatch()


def is_installed() -> bool:
    """Whether the aten SDPA override is registered (some thread is inside enable())."""
    return _library is not None


class enable(contextlib.ContextDecorator):
    """Routes this thread's scaled_dot_product_attention calls to our kernels.

    A context manager and a decorator; nestable (the innermost strict setting
    applies) and thread-local. Calls that cannot be served run PyTorch's own SDPA
    (a DEBUG line on the "torch_flash_backend" logger gives the reason), or raise
    UnsupportedError when strict=True.

    Wrap compiled functions from outside: a function compiled inside enable() is
    recompiled when called outside it, and vice versa.
    """

    def __init__(self, strict: bool = False):
        self.strict = bool(strict)

    def __enter__(self):
        mode = _StrictRouting() if self.strict else _Routing()
        _acquire()
        try:
            mode.__enter__()
        except BaseException:
            _release()
            raise
        _modes().append(mode)
        return self

    def __exit__(self, *exc_info):
        mode = _modes().pop()
        try:
            mode.__exit__(*exc_info)
        finally:
            _release()
        return False


def explain(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Whether enable() would serve this SDPA call, by which kernel, or why not.

    The result prints as "served by <kernel> (...)" or "falls back to PyTorch
    SDPA: <reason>", and has .served, .kernel and .reason.
    """
    return _router.decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
