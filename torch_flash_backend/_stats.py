"""Process-wide counts of routed calls (by kernel) and fallbacks (by reason).

Counting happens where the routing decision is made: an eager call counts once
per call; a torch.compile'd or exported graph counts when it is traced, never
when the compiled code runs (torch.compile traces each call site in a few
passes, about three counts per compilation). enable()'s eager calls decided
from the op library's cache count in csrc/routing.cpp, under the decision's
number (_router.number_of).
"""
import collections
import threading

import torch

from . import _router

_lock = threading.Lock()
_routed: collections.Counter = collections.Counter()
_fallback: collections.Counter = collections.Counter()


def _line(decision) -> tuple[bool, str]:
    return (True, decision.kernel) if decision.served else (False, decision.reason)


def count(decision) -> None:
    with _lock:
        if decision.served:
            _routed[decision.kernel] += 1
        else:
            _fallback[decision.reason] += 1


def stats() -> dict[str, dict[str, int]]:
    """{"routed": {kernel: calls}, "fallback": {reason: calls}} since the last reset_stats()."""
    cached = torch.ops.torch_flash_backend.routing_counts()
    decisions = _router.numbered()
    with _lock:
        routed, fallback = collections.Counter(_routed), collections.Counter(_fallback)
        for i, decision in enumerate(decisions):
            if cached[i]:
                served, name = _line(decision)
                (routed if served else fallback)[name] += cached[i]
        return {"routed": dict(routed), "fallback": dict(fallback)}


def reset_stats() -> None:
    with _lock:
        _routed.clear()
        _fallback.clear()
        torch.ops.torch_flash_backend.routing_reset_counts()
