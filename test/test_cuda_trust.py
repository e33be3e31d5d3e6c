"""Inputs at the edges, on the GPU: a zero scale, values near the dtype's
largest, NaN and inf, grids past CUDA's 65535 limit on y and z, and the
deterministic backward. Every forward family runs each case (the `family`
fixture) with sm80 allowed besides it: the backward is the family's own where
it has one for the head dim (sm90 has every one it has a forward for), else sm80's.
"""
import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_flash_backend as tfb
from torch_flash_backend import testing

from reference import assert_within_baseline, attention_ref, max_err

pytestmark = pytest.mark.gpu


def _families():
    built = tfb.built_kernels()
    return [f for f in ("sm80", "sm90") if any(n.startswith(f"{f}_fwd") for n in built)]


@pytest.fixture(params=["sm80", "sm90"])
def family(request):
    if request.param not in _families():
        pytest.skip(f"no {request.param} forward built")
    if request.param == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 kernels run on compute capability 9.0 only")
    with testing.kernel_families(request.param, "sm80"):  # sm80 serves the backwards sm90 lacks
        yield request.param


def _ref(q, k, v, grad, **kw):
    """The float64 reference's output and gradients, from float64 leaves."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*leaves, **kw)
    return ref, torch.autograd.grad(ref, leaves, grad.double())


def _pytorch(q, k, v, grad, **kw):
    """PyTorch's (out, dq, dk, dv) per tensor with the larger error against the
    float64 reference, of its default backend and its flash backend, each where
    it runs (the baseline test_cuda_bwd.py takes: our backward is FA2's, which
    rounds dS to the input dtype as PyTorch's flash does)."""
    runs = []
    for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        if backend == SDPBackend.MATH and runs:
            break  # math only where neither runs (B * H past 65535: both refuse it)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        try:
            with sdpa_kernel(backend) if backend else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(*leaves, **kw)
            runs.append((out, *torch.autograd.grad(out, leaves, grad)))
        except RuntimeError:  # e.g. a grid past what the backend launches
            continue
    assert runs, "no PyTorch backend ran this call"
    ref, ref_grads = _ref(q, k, v, grad, is_causal=kw.get("is_causal", False), scale=kw.get("scale"))
    refs = (ref, *ref_grads)
    return [max((run[i] for run in runs), key=lambda t: max_err(t, refs[i])) for i in range(4)], refs


def _qkv(b, h, length, e, dtype=torch.bfloat16, hkv=None, s=None, requires_grad=False):
    hkv, s = hkv or h, s or length
    shapes = ((b, length, h, e), (b, s, hkv, e), (b, s, hkv, e))
    return [torch.randn(*shape, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_(requires_grad)
            for shape in shapes]


@pytest.mark.parametrize("e", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_scale_is_uniform_attention(family, e, causal):
    """scale=0: every visible key weighs the same, and the gradients are finite
    (dq and dk are exactly 0: the output does not depend on q or k)."""
    q, k, v = _qkv(1, 2, 100, e, requires_grad=True)
    out = tfb.flash_attn(q, k, v, is_causal=causal, scale=0.0)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    ref, ref_grads = _ref(q, k, v, grad, scale=0.0, is_causal=causal)
    with sdpa_kernel(SDPBackend.MATH):
        base = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.0)
        base_grads = torch.autograd.grad(base, (q, k, v), grad)
    assert_within_baseline("out", out, base, ref)
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk))
    assert_within_baseline("dv", dv, base_grads[2], ref_grads[2])


@pytest.mark.parametrize("dtype,value", [(torch.bfloat16, 133120.0), (torch.float16, 65504.0)])
@pytest.mark.parametrize("causal", [False, True])
def test_large_equal_values(family, dtype, value, causal):
    """PyTorch's test_flash_attention_large_bf16_nan_values: q = k = v = a value
    near the dtype's largest; every score is equal, so the output is the value."""
    x = torch.full((1, 1, 1, 64), value, device="cuda", dtype=dtype)
    out = tfb.flash_attn(x, x, x, is_causal=causal)
    assert torch.equal(out, x), out
    x = torch.full((1, 2, 128, 128), value, device="cuda", dtype=dtype)
    with tfb.enable(strict=True):
        out = F.scaled_dot_product_attention(x, x, x, is_causal=causal)
    assert torch.equal(out, x), out.flatten()[:4]


@pytest.mark.parametrize("e", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_large_scores_take_the_exact_path(family, e, causal):
    """Scores of 1e3 to 1e5 in log2 units, a row max varying from row to row:
    the warps whose max reaches the fused form's limit take the two-step form;
    the output stays within the 2x rule of the float64 reference."""
    q, k, v = _qkv(2, 4, 333, e)
    q = q * torch.linspace(1, 40, 333, device="cuda", dtype=q.dtype).view(1, 1, -1, 1)
    k = k * 8
    out = tfb.flash_attn(q, k, v, is_causal=causal)
    ref, _ = attention_ref(q, k, v, is_causal=causal)
    # PyTorch's flash kernel keeps scores in float32 too (the bf16 math path
    # rounds them to bf16, an error this test would not see past).
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        base = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert_within_baseline("out", out, base, ref)


def _classes(t):
    """Per element: 0 finite, 1 NaN, 2 +inf, 3 -inf."""
    c = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
    c[torch.isnan(t)] = 1
    c[torch.isposinf(t)] = 2
    c[torch.isneginf(t)] = 3
    return c


# (tensor, row, dim): rows and keys whose effect does not depend on tile sizes.
# A NaN in v at key j also reaches, through 0 * NaN in the P V product, rows
# i < j of a causal tile that the kernel visits with key j; which rows those are
# depends on each kernel's tile shape (PyTorch's flash kernels do the same), so
# the causal cases put it at key 0, which every row sees.
POISON = [("q", 5, 3), ("k", 0, 7), ("k", 37, 1), ("v", 0, 2)]


@pytest.mark.parametrize("e", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", POISON, ids=lambda w: f"{w[0]}{w[1]}")
def test_nan_inf_positions_match_pytorch_flash(family, e, causal, value, where):
    """Where the output and the gradients hold NaN, +inf or -inf is what
    PyTorch's flash backend gives on the same inputs."""
    name, row, dim = where
    if name == "v" and not causal:
        row = 70
    q, k, v = _qkv(1, 2, 130, e)
    {"q": q, "k": k, "v": v}[name].detach()[0, 1, row, dim] = value
    grad = torch.randn(1, 130, 2, e, device="cuda", dtype=q.dtype).transpose(1, 2)

    def run(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, grad))

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        theirs = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal))
    ours = run(lambda a, b, c: tfb.flash_attn(a, b, c, is_causal=causal))
    for label, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        ca, cb = _classes(a), _classes(b)
        differ = (ca != cb).nonzero()
        assert differ.numel() == 0, (f"{label}: {differ.shape[0]} elements differ in class, first at "
                                     f"{differ[0].tolist()}: ours {ca[tuple(differ[0])]}, flash {cb[tuple(differ[0])]}")


@pytest.mark.parametrize("shape", [(70000, 1, 32, 64), (1, 70000, 32, 64), (300, 300, 17, 64)])
def test_batch_times_heads_past_grid_limit(family, shape):
    """B * H > 65535 CTAs along grid y / z: forward and backward."""
    b, h, length, e = shape
    q, k, v = (torch.randn(b, h, length, e, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = tfb.flash_attn(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    bases, refs = _pytorch(q, k, v, grad, is_causal=True)
    for name, ours, base, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), bases, refs):
        # Over 10^8 elements one rounding may fall either way (one bf16 ulp); a
        # grid that lost or swapped heads would be off by the values themselves.
        ulp = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 7)
        assert_within_baseline(name, ours, base, ref, floor=ulp)


# The last case has batch x kv heads past the SM count: one dQ split, one CTA per (kv head, batch).
@pytest.mark.parametrize("e,hq,hkv,length", [(64, 4, 4, 1000), (96, 6, 2, 500), (128, 8, 2, 777), (192, 4, 2, 333),
                                             (256, 2, 1, 300), (64, 80, 80, 300)])
@testing.deterministic_algorithms()
def test_deterministic_backward_is_bitwise_repeatable(e, hq, hkv, length):
    q, k, v = _qkv(2, hq, length, e, hkv=hkv, requires_grad=True)
    out = tfb.flash_attn(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn_like(out)
    runs = [torch.autograd.grad(out, (q, k, v), grad, retain_graph=True) for _ in range(5)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    bases, refs = _pytorch(q, k, v, grad, is_causal=True, enable_gqa=True)
    for name, ours, base, ref in zip(("dq", "dk", "dv"), runs[0], bases[1:], refs[1:]):
        assert_within_baseline(name, ours, base, ref)


@testing.deterministic_algorithms(warn_only=True)
def test_warn_only_warns_once_like_pytorch():
    q, k, v = _qkv(1, 2, 64, 64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tfb.flash_attn(q, k, v).sum().backward()
    assert any("non-deterministic" in str(w.message) for w in caught), [str(w.message) for w in caught]
