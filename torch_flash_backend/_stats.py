"""Process-wide counts of routed calls (by kernel) and fallbacks (by reason).

Counting happens where the routing decision is made: an eager call counts once
per call; a torch.compile'd or exported graph counts when it is traced, never
when the compiled code runs (torch.compile traces each call site in a few
passes, about three counts per compilation). enable()'s eager calls decided
from its cache count in csrc/routing.cpp, under the line's id given here.
"""
import collections
import threading

import torch

_lock = threading.Lock()
_routed: collections.Counter = collections.Counter()
_fallback: collections.Counter = collections.Counter()
_ids: dict[tuple[bool, str], int] = {}
_MAX_IDS = 4096  # csrc/routing.cpp's kMaxStats


def _line(decision) -> tuple[bool, str]:
    return (True, decision.kernel) if decision.served else (False, decision.reason)


def count(decision) -> None:
    with _lock:
        if decision.served:
            _routed[decision.kernel] += 1
        else:
            _fallback[decision.reason] += 1


def line_id(decision) -> int:
    """The id under which the op library counts this decision's cached calls; -1
    once the ids run out (such calls then ask the router each time)."""
    line = _line(decision)
    with _lock:
        found = _ids.get(line)
        if found is None and len(_ids) < _MAX_IDS:
            found = _ids[line] = len(_ids)
        return -1 if found is None else found


def stats() -> dict[str, dict[str, int]]:
    """{"routed": {kernel: calls}, "fallback": {reason: calls}} since the last reset_stats()."""
    cached = torch.ops.torch_flash_backend.routing_counts()
    with _lock:
        routed, fallback = collections.Counter(_routed), collections.Counter(_fallback)
        for (served, name), i in _ids.items():
            if cached[i]:
                (routed if served else fallback)[name] += cached[i]
        return {"routed": dict(routed), "fallback": dict(fallback)}


def reset_stats() -> None:
    with _lock:
        _routed.clear()
        _fallback.clear()
        torch.ops.torch_flash_backend.routing_reset_counts()
