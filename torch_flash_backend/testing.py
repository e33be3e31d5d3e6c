"""Switches for tests: route CPU calls, and pretend to be a given CUDA device.

Not for production use: on CPU, PyTorch's own SDPA is the right choice.
"""
import contextlib

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
