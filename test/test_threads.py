"""enable() entered and left by many threads at once (lenient and strict mixed),
each running forward and backward, while another thread runs SDPA outside it.

On CPU the routing goes to the CPU ops (testing.route_cpu); on a GPU, to the
CUDA kernels. Every result must equal the single-thread one, stats() must count
every routed call, and nothing may stay routed afterwards.
"""
import threading

import pytest
import torch
import torch.nn.functional as F

import torch_flash_backend as tfb
from torch_flash_backend import _enable, testing

THREADS = 4
ITERS = 30


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(2, 4, 40, 64, generator=g).to(device, dtype) for _ in range(4)]


def _step(q, k, v, grad):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad))


def _same(a, b, device):
    # dQ is summed with atomics on the GPU: equal up to the order of float adds.
    out, dq, dk, dv = zip(a, b)
    ok = torch.equal(*out) and torch.equal(*dk) and torch.equal(*dv)
    return ok and (torch.equal(*dq) or (device == "cuda" and torch.allclose(*dq, rtol=1e-2, atol=1e-2)))


@pytest.mark.parametrize("device", _devices())
def test_many_threads_enter_and_leave(device):
    q, k, v, grad = _inputs(device)
    with testing.route_cpu():
        with tfb.enable(strict=True):
            want_ours = _step(q, k, v, grad)
        want_pytorch = _step(q, k, v, grad)
        tfb.reset_stats()
        errors, stop = [], threading.Event()

        def inside(strict):
            try:
                for _ in range(ITERS):
                    with tfb.enable(strict=strict):
                        got = _step(q, k, v, grad)
                    if not _same(got, want_ours, device):
                        errors.append(f"enable(strict={strict}) result differs")
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(f"enable(strict={strict}): {type(e).__name__}: {e}")

        def outside():
            n = 0
            try:
                while not stop.is_set() or n < 5:
                    if not _same(_step(q, k, v, grad), want_pytorch, device):
                        errors.append("outside enable(): result differs from PyTorch's")
                    n += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(f"outside enable(): {type(e).__name__}: {e}")

        workers = [threading.Thread(target=inside, args=(i % 2 == 1,)) for i in range(THREADS)]
        watcher = threading.Thread(target=outside)
        watcher.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        stop.set()
        watcher.join()
        if device == "cuda":
            torch.cuda.synchronize()
        stats = tfb.stats()
    assert not errors, errors[:5]
    assert sum(stats["routed"].values()) == THREADS * ITERS, stats
    assert not stats["fallback"], stats
    assert not _enable.is_active()
    with testing.route_cpu():
        assert _same(_step(q, k, v, grad), want_pytorch, device)
    assert sum(tfb.stats()["routed"].values()) == THREADS * ITERS


@pytest.mark.gpu
@pytest.mark.parametrize("e", [64, 128, 256])
def test_forward_as_a_new_threads_first_cuda_call(e):
    """The sm90 forward encodes TMA descriptors through the driver API, which
    needs the CUDA context bound to the calling thread; in a new thread our op
    may be the first CUDA work (this failed with an illegal instruction)."""
    q = torch.randn(2, 4, 300, e, device="cuda", dtype=torch.bfloat16)
    want = tfb.flash_attn(q, q, q, is_causal=True)
    got = []
    thread = threading.Thread(target=lambda: got.append(tfb.flash_attn(q, q, q, is_causal=True)))
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    assert len(got) == 1 and torch.equal(got[0], want)
