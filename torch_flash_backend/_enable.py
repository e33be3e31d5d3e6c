"""enable(): routes the SDPA calls made in this thread to our ops.

Routing sits in the dispatcher, not in Python: the op library gives
aten::scaled_dot_product_attention a kernel at the autograd and backend keys of
CPU and CUDA (csrc/routing.cpp), registered once when it loads. Outside enable()
that kernel calls PyTorch's own (CompositeImplicitAutograd) kernel; inside, it
takes a decision it cached for the same metadata, or asks
torch_flash_backend::route_sdpa, whose Python kernel below decides (and hands
the decision back to the cache). That also catches the calls made from C++
(nn.MultiheadAttention and nn.TransformerEncoderLayer fast paths). enable()
itself only sets thread-local state (_mark_routing), so any number of threads may enter
and leave it while others run SDPA, and no other torch call pays for it.
torch.compile and torch.export: see _Routing.
"""
import dataclasses
import functools
import logging
import threading
import warnings

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _fp8, _router, _stats
from . import _autograd  # noqa: F401  (the ops, fake kernels and autograd)
from ._causal import CausalBias, bottom_right_of, causal_flags, lower_right

_ops = torch.ops.torch_flash_backend

logger = logging.getLogger("torch_flash_backend")

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


class UnsupportedError(RuntimeError):
    """Raised under enable(strict=True) for an SDPA call our kernels cannot serve."""

    def __init__(self, reason: str):
        super().__init__(f"torch_flash_backend cannot serve this scaled_dot_product_attention call: {reason}")
        self.reason = reason


class _Routing(TorchFunctionMode):
    """The routing of a traced enable(), entered inside a function that Dynamo
    compiles or torch.export traces (eager code pays nothing per torch call for
    enable(): this mode is not pushed there).

    A function compiled outside enable() and called inside it (or the reverse)
    recompiles: enable() marks itself in state Dynamo guards on
    (csrc/routing.cpp), and AOTAutograd's trace of the graph meets the
    dispatcher-level switch. Where that switch cannot see the call this mode
    routes it: in a graph torch.compile's Dynamo traces it emits route_sdpa,
    decided when AOTAutograd traces the graph; torch.export keeps
    aten::scaled_dot_product_attention whole in its graphs, so an SDPA call an
    export traces is decided here (with strict=True, when the export traces
    Dynamo's graph: _exported_sdpa).
    """

    strict = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            if torch.compiler.is_dynamo_compiling() and not _exporting():
                return _route_op(*args, strict=self.strict, **kwargs)
            if torch.compiler.is_dynamo_compiling():
                # torch.export(strict=True): Dynamo keeps this call whole and the
                # export's trace of Dynamo's graph runs it (_route_for_export).
                return _exported_sdpa_strict(*args, **kwargs) if self.strict else _exported_sdpa(*args, **kwargs)
            if _exporting():
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
    attn_mask, is_causal, bottom_right = causal_flags(attn_mask, is_causal, "scaled_dot_product_attention")
    # bottom_right only when set, so that graphs without it read as before.
    extra = {"bottom_right": True} if bottom_right else {}
    return _ops.route_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, strict, **extra)


_local = threading.local()


# enable()'s state in eager code, which the dispatcher-level switch reads and
# Dynamo guards on: autocast for IPU on, its dtype saying how calls are routed
# (csrc/routing.cpp, routing_frame). Each enable() restores what it found.
_MARK_DEVICE = "ipu"
_MARK_DTYPES = {(False, False): torch.bfloat16, (True, False): torch.float32, (False, True): torch.float16,
                (True, True): torch.float64}


def _mark_routing(strict: bool, log_each_call: bool) -> None:
    _marks().append((torch.is_autocast_enabled(_MARK_DEVICE), torch.get_autocast_dtype(_MARK_DEVICE)))
    torch.set_autocast_enabled(_MARK_DEVICE, True)
    torch.set_autocast_dtype(_MARK_DEVICE, _MARK_DTYPES[strict, log_each_call])


def _unmark_routing() -> None:
    enabled, dtype = _marks().pop()
    torch.set_autocast_enabled(_MARK_DEVICE, enabled)
    torch.set_autocast_dtype(_MARK_DEVICE, dtype)


def _marks() -> list:
    marks = getattr(_local, "marks", None)
    if marks is None:
        marks = _local.marks = []
    return marks


def _modes() -> list:
    modes = getattr(_local, "modes", None)
    if modes is None:
        modes = _local.modes = []
    return modes


def _decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, strict, bottom_right):
    """enable()'s decision; strict: our kernels or an error, so a call left to
    PyTorch only because PyTorch is faster there (a single decode token, a
    packed batch on Hopper) is served by any kernel of ours that can run it."""
    decision = _router.decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, bottom_right=bottom_right)
    if strict and not decision.served:
        pinned = _router.decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, bottom_right=bottom_right,
                                pinned=True)
        if pinned.served:
            return pinned
    return decision


def _route(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, strict, fallback, bottom_right=False):
    decision = _decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, strict, bottom_right)
    _stats.count(decision)
    if decision.served:
        logger.debug("scaled_dot_product_attention %s", decision)
        # attn_mask and bottom_right only when given, so that graphs without them read as before.
        extra = {} if attn_mask is None else {"attn_mask": attn_mask}
        if bottom_right:
            extra["bottom_right"] = True
        if dropout_p != 0.0:
            return _ops.dropout_fwd(q, k, v, float(dropout_p), scale, is_causal, decision.family,
                                    decision.backward_family, **extra)[0]
        return _ops.fwd(q, k, v, scale, is_causal, decision.family, decision.backward_family, **extra)[0]
    if strict:
        raise UnsupportedError(decision.reason)
    logger.debug("scaled_dot_product_attention falls back to PyTorch SDPA: %s", decision.reason)
    return fallback()


def _route_for_export(func, args, kwargs, strict):
    def call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        attn_mask, is_causal, bottom_right = causal_flags(attn_mask, is_causal, "scaled_dot_product_attention")
        return _route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, strict, fallback,
                      bottom_right)

    def fallback():
        _local.decided = True  # the dispatcher-level kernel must not decide (and count) again
        try:
            return func(*args, **kwargs)
        finally:
            _local.decided = False

    return call(*args, **kwargs)


@torch.compiler.allow_in_graph
def _exported_sdpa(*args, **kwargs):
    return _route_for_export(F.scaled_dot_product_attention, args, kwargs, False)


@torch.compiler.allow_in_graph
def _exported_sdpa_strict(*args, **kwargs):
    return _route_for_export(F.scaled_dot_product_attention, args, kwargs, True)


def _pytorch_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return _SDPA.decompose(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _pytorch_lower_right(q, k, v, dropout_p, scale, enable_gqa):
    return _pytorch_causal_bias(q, k, v, lower_right(q, k), dropout_p, False, scale, enable_gqa)


def _route_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                strict=False, bottom_right=False):
    if bottom_right:  # a CausalBias made by causal_lower_right (_route_op)
        args = (query, key, value, dropout_p, scale, enable_gqa)
        return _route(query, key, value, None, dropout_p, True, scale, enable_gqa, strict,
                      fallback=lambda: _pytorch_lower_right(*args), bottom_right=True)
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if getattr(_local, "decided", False):
        return _pytorch_sdpa(*args)
    if _exporting() and _modes() and _modes()[-1] is None:
        # torch.export computing the output of the SDPA call it keeps whole in
        # its graph, inside an enable() entered before it: too late to route.
        warnings.warn("torch_flash_backend: torch.export traced scaled_dot_product_attention inside an enable() "
                      "entered before the export, which cannot route it; the exported program runs PyTorch's "
                      "SDPA. Export tfb.enable()(model) to route it.", stacklevel=2)
        return _pytorch_sdpa(*args)
    return _route(*args, strict, fallback=lambda: _pytorch_sdpa(*args))


# A CausalBias attn_mask runs F.scaled_dot_product_attention itself (its
# __torch_function__, CausalBias._dispatch): an upper-left or square one as SDPA
# with is_causal=True, which reaches the switch; a lower-right one of unequal
# lengths through PyTorch's flash or efficient ops, past it. So enable() routes
# the latter here: CausalBias._dispatch is replaced, once, by one that routes
# them inside enable() and calls PyTorch's own everywhere else.
_pytorch_causal_bias = CausalBias._dispatch
_STRICT_OF_MARK = {dtype: strict for (strict, _log), dtype in _MARK_DTYPES.items()}


def routing_strictness() -> bool | None:
    """The strictness of this thread's innermost eager enable(), None outside one."""
    if not torch.is_autocast_enabled(_MARK_DEVICE):
        return None
    return _STRICT_OF_MARK.get(torch.get_autocast_dtype(_MARK_DEVICE))


def _causal_bias_dispatch(query, key, value, attn_mask, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False):
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    strict = routing_strictness()
    if strict is None or is_causal or getattr(_local, "decided", False) or not bottom_right_of(attn_mask):
        return _pytorch_causal_bias(*args)
    return _route(query, key, value, None, dropout_p, True, scale, enable_gqa, strict,
                  fallback=lambda: _pytorch_causal_bias(*args), bottom_right=True)


CausalBias._dispatch = staticmethod(_causal_bias_dispatch)

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
    torch.compile(fullgraph=True), as a with-statement or a decorator. Packed
    variable-length batches (varlen_attn, SDPA on nested jagged tensors) made
    in eager code inside it are routed too (_provider.py's switch).

    A function compiled outside enable() is recompiled when called inside it,
    and vice versa, never per call.

    torch.export routes the SDPA calls of code that runs inside enable() while
    it is traced: export enable()(model), a module whose forward runs the
    model's inside enable() (its parameters are under "module."). An export
    merely started inside enable() keeps PyTorch's SDPA in its graph, with a
    warning: eager code pays nothing per torch call for enable(), so nothing
    sees the trace start.
    """

    def __init__(self, strict: bool = False):
        self.strict = bool(strict)

    def __call__(self, fn):
        if isinstance(fn, torch.nn.Module):
            return _RoutedModule(fn, self.strict)
        # A fresh context manager per call, made inside the decorated function:
        # Dynamo enters only context managers created inside the compiled region.
        strict = self.strict

        @functools.wraps(fn)
        def routed(*args, **kwargs):
            with enable(strict=strict):
                return fn(*args, **kwargs)

        return routed

    def __enter__(self):
        if torch.compiler.is_dynamo_compiling():
            mode = _StrictRouting() if self.strict else _Routing()
            mode.__enter__()  # traced: the mode routes the graph's SDPA calls
            return self
        if _exporting():
            # A torch.export trace runs this code: the mode routes its SDPA calls
            # (the trace keeps them whole, out of the switch's sight).
            mode = _StrictRouting() if self.strict else _Routing()
            mode.__enter__()
        else:
            mode = None
            _mark_routing(self.strict, logger.isEnabledFor(logging.DEBUG))
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
        if mode is None:
            _unmark_routing()
        else:
            mode.__exit__(*exc_info)
        return False


class _RoutedModule(torch.nn.Module):
    """enable()(module): the module, called inside enable() (for torch.export)."""

    def __init__(self, module: torch.nn.Module, strict: bool):
        super().__init__()
        self.module = module
        self.strict = strict

        # The module's signature, so that an exported program names its inputs alike.
        @functools.wraps(module.forward)
        def forward(*args, **kwargs):
            with enable(strict=self.strict):
                return self.module(*args, **kwargs)

        self.forward = forward


def explain(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            strict=False):
    """Whether enable(strict=strict) would serve this SDPA call, by which kernel,
    or why not (strict also serves what enable() leaves to PyTorch only
    because PyTorch is faster there).

    The result prints as "served by <kernel> (...)" or "falls back to PyTorch
    SDPA: <reason>", and has .served, .kernel and .reason. For a served masked
    call, .tiles_skipped is the share of the forward kernel's tiles the mask
    hides entirely (which the kernel skips); it reads the mask (a device sync).
    Nested jagged tensors (torch.nested, layout=torch.jagged): the decision for
    the packed call SDPA's flash backend makes of them (explain_varlen's; their
    longest length may be read from the device). float8_e4m3fn q, k, v: the
    decision for _scaled_dot_product_attention_quantized's call (the FP8 kernel).
    """
    if isinstance(q, torch.Tensor) and q.dtype == _fp8.FP8:
        return _fp8.decide(q, k, v, dropout_p, is_causal)
    if any(isinstance(t, torch.Tensor) and t.is_nested for t in (q, k, v)):
        return _explain_jagged(q, k, v, attn_mask, dropout_p, is_causal, scale, strict)
    attn_mask, is_causal, bottom_right = causal_flags(attn_mask, is_causal, "explain")
    decision = _decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, strict, bottom_right)
    if (decision.served and attn_mask is not None and q.device.type == "cuda"
            and type(attn_mask) is torch.Tensor):
        decision = dataclasses.replace(decision, tiles_skipped=_router.tiles_skipped(decision, attn_mask, q, k))
    return decision


def _explain_jagged(q, k, v, attn_mask, dropout_p, is_causal, scale, strict):
    if not all(isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged for t in (q, k, v)):
        return _router._fallback("q, k and v must all be nested tensors of layout torch.jagged, or none")
    if attn_mask is not None:
        return _router._fallback("attn_mask with nested jagged inputs: PyTorch's SDPA takes none there")
    from torch.nested._internal.sdpa import _sdpa_nested_preprocessing
    q_t, k_t, v_t, cu_q, cu_k, max_q, max_k, _ = _sdpa_nested_preprocessing(q, k, v)
    return _router.decide_varlen(q_t, k_t, v_t, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale,
                                 needs_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
                                 pinned=bool(strict))


def explain_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                   strict=False):
    """explain() for torch.nn.attention.varlen.varlen_attn's arguments (a
    packed batch: q (total_q, Hq, E), k and v (total_k, Hkv, E), int32
    offsets): whether enable(strict=strict) would serve the call, by which
    kernels, or why not. Causal when window_size is (-1, 0), as varlen_attn
    reads it; windows bottom-right per sequence. Metadata only."""
    window = (int(window_size[0]), int(window_size[1]))
    return _router.decide_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, window == (-1, 0), scale, window,
                                 pinned=bool(strict))
