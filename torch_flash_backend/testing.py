"""Switches for tests: route CPU calls, pretend to be a given CUDA device, pin
the kernel family; and which families a call launched.

Not for production use: on CPU, PyTorch's own SDPA is the right choice.
"""
import contextlib
import os

import torch

from . import _router


@contextlib.contextmanager
def route_cpu():
    """Lets enable() route CPU calls (float32 too) to the CPU ops, so that the
    whole routing path can be tested on a machine without a GPU. Process-wide."""
    _router.probe.add_cpu_route(1)
    try:
        yield
    finally:
        _router.probe.add_cpu_route(-1)


@contextlib.contextmanager
def pretend_cuda(capability=(8, 0), kernels=None, smem_per_block=227 * 1024):
    """Makes the router see every CUDA device with this compute capability and
    these built kernel names (default: sm80 fwd and bwd for fp16/bf16 and every
    head dim). Process-wide; not thread-safe."""
    if kernels is None:
        kernels = [f"sm80_{p}_{d}_hdim{e}" for p in ("fwd", "bwd") for d in ("fp16", "bf16")
                   for e in (32, 64, 96, 128, 192, 256)]
    kernels = frozenset(kernels)
    probe = _router.probe
    saved = probe.capability, probe.kernels, probe.smem_per_block
    probe.capability = lambda device: tuple(capability)
    probe.kernels = lambda: kernels
    probe.smem_per_block = lambda device: smem_per_block
    try:
        yield
    finally:
        probe.capability, probe.kernels, probe.smem_per_block = saved


@contextlib.contextmanager
def kernel_families(*names):
    """Lets the CUDA ops and the router use only these kernel families, e.g.
    kernel_families("sm80") runs the forward with sm80 on Hopper too; no names:
    every family. Sets TFB_KERNEL_FAMILIES for its duration and restores the
    previous value on exit, so it is process-wide and not thread-safe.

    Also a decorator (``@kernel_families("sm80")`` on a test function), and a
    pytest fixture body::

        @pytest.fixture(params=["sm80", "sm90"])
        def family(request):
            with kernel_families(request.param):
                yield request.param
    """
    unknown = [n for n in names if n not in _router.FAMILIES]
    if unknown:
        raise ValueError(f"unknown kernel families {unknown}; known: {', '.join(_router.FAMILIES)}")
    env = _router.FAMILIES_ENV
    previous = os.environ.get(env)
    os.environ[env] = ",".join(names)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = previous


@contextlib.contextmanager
def deterministic_algorithms(warn_only: bool = False):
    """torch.use_deterministic_algorithms(True, warn_only=...) for a with block,
    the previous setting restored after it. Process-wide."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def launched_families(fn) -> set[str]:
    """The kernel families ("sm80", "sm90") whose CUDA kernels fn() launches, read
    off the kernel names the profiler records: each family's kernels live in the
    C++ namespace tfb::<family>."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = {e.name for e in events if e.device_type == DeviceType.CUDA} | {k.name for e in events for k in e.kernels}
    if not kernels:
        raise RuntimeError("the profiler recorded no CUDA kernels (is CUPTI available?)")
    # Demangled names read "tfb::sm90::..."; mangled ones hold "3tfb4sm90".
    return {f for f in _router.FAMILIES for n in kernels if f"tfb::{f}::" in n or f"3tfb4{f}" in n}
