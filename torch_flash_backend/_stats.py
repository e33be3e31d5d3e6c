"""Process-wide counts of routed calls (by kernel) and fallbacks (by reason).

Counting happens where the routing decision is made: an eager call counts once
per call; a torch.compile'd or exported graph counts when it is traced, never
when the compiled code runs (torch.compile traces each call site in a few
passes, about three counts per compilation).
"""
import collections
import threading

_lock = threading.Lock()
_routed: collections.Counter = collections.Counter()
_fallback: collections.Counter = collections.Counter()


def count(decision) -> None:
    with _lock:
        if decision.served:
            _routed[decision.kernel] += 1
        else:
            _fallback[decision.reason] += 1


def stats() -> dict[str, dict[str, int]]:
    """{"routed": {kernel: calls}, "fallback": {reason: calls}} since the last reset_stats()."""
    with _lock:
        return {"routed": dict(_routed), "fallback": dict(_fallback)}


def reset_stats() -> None:
    with _lock:
        _routed.clear()
        _fallback.clear()
