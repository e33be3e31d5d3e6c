"""Switches for tests: route CPU calls, pretend to be a given CUDA device, pin
the kernel family; and which families a call launched.

Not for production use: on CPU, PyTorch's own SDPA is the right choice.
"""
import contextlib
import os

import torch

from . import _router
from ._library import Kernel, family_limits


@contextlib.contextmanager
def route_cpu():
    """Lets enable() route CPU calls (float32 too) to the CPU ops, so that the
    whole routing path can be tested on a machine without a GPU. Process-wide."""
    _router.probe.add_cpu_route(1)
    try:
        yield
    finally:
        _router.probe.add_cpu_route(-1)


def fake_kernels(names, smem_bytes=None) -> frozenset:
    """Kernel records for names like "sm80_bwd_bf16_hdim128", with their family's
    limits from the registry; smem_bytes maps a pass to the shared memory its
    blocks need (default: fwd 48 KB, bwd 144 KB, typical of the sm80 kernels)."""
    smem = {"fwd": 48 * 1024, "bwd": 144 * 1024, **(smem_bytes or {})}
    limits = {f: line.split(" passes=")[0] for f, line in family_limits().items()}
    records = []
    for name in names:
        family, pass_, dtype, hdim = name.split("_")
        records.append(Kernel.parse(f"{name} family={family} pass={pass_} dtype={dtype} head_dim={hdim[4:]} "
                                    f"{limits[family]} smem_bytes={smem[pass_]}"))
    return frozenset(records)


def registry_kernel_names(*families) -> list[str]:
    """Every instantiation the registry names for these families (all by default)."""
    names = []
    for family, line in family_limits().items():
        if families and family not in families:
            continue
        fields = dict(f.split("=", 1) for f in line.split())
        for entry in fields["head_dims"].split(";"):  # "fwd:64,128;bwd:64"
            p, dims = entry.split(":")
            names += [f"{family}_{p}_{d}_hdim{e}" for d in ("fp16", "bf16") for e in dims.split(",")]
    return names


@contextlib.contextmanager
def pretend_cuda(capability=(8, 0), kernels=None, smem_per_block=227 * 1024, smem_bytes=None):
    """Makes the router see every CUDA device with this compute capability and
    these built kernels (names; default: the registry's sm80 kernels), with
    fake_kernels' records. Process-wide; not thread-safe."""
    if kernels is None:
        kernels = registry_kernel_names("sm80")
    kernels = fake_kernels(kernels, smem_bytes)
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
    """Lets the router (enable(), explain(), flash_attn, PyTorch's flash hook)
    choose only these kernel families, e.g. kernel_families("sm80") runs the
    forward with sm80 on Hopper too; no names: every family. The ops themselves
    run the family they are given (family=...; the CUDA ops raise without
    one), so a direct op call follows it through _router.pinned_families. Sets
    TFB_KERNEL_FAMILIES for its duration and restores the previous value on
    exit, so it is process-wide and not thread-safe.

    Also a decorator (``@kernel_families("sm80")`` on a test function), and a
    pytest fixture body::

        @pytest.fixture(params=["sm80", "sm90"])
        def family(request):
            with kernel_families(request.param):
                yield request.param
    """
    unknown = [n for n in names if n not in _router.families()]
    if unknown:
        raise ValueError(f"unknown kernel families {unknown}; known: {', '.join(_router.families())}")
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
    return {f for f in _router.families() for n in kernels if f"tfb::{f}::" in n or f"3tfb4{f}" in n}
