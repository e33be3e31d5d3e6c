"""Causal masking aligned bottom-right: torch.nn.attention.bias.causal_lower_right
(a CausalBias attn_mask) and PyTorch's flash ops' is_causal, as the ops'
bottom_right=True. Row i sees keys j <= i + S - L; rows before the diagonal
(L > S) see none and give 0, as PyTorch's. CPU tests route through the test
switch; GPU tests run every family against the float64 reference."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import torch_flash_backend as tfb
from torch_flash_backend import _router, testing

from reference import assert_within_baseline, attention_ref, max_err

ops = torch.ops.torch_flash_backend

# (L, S): L < S (a chunk of queries after a cache), L > S (rows with no key), square.
SHAPES = [(5, 40), (33, 50), (50, 33), (40, 5), (40, 40)]


def lower_right_mask(length, s, device="cpu"):
    return torch.ones(length, s, dtype=torch.bool, device=device).tril(s - length)


def qkv(hq=4, hkv=2, length=33, s=50, e=32, dtype=torch.float32, device="cpu", requires_grad=False, seed=0):
    torch.manual_seed(seed)
    return tuple(torch.randn(2, n, h, e, dtype=dtype, device=device).transpose(1, 2).requires_grad_(requires_grad)
                 for h, n in ((hq, length), (hkv, s), (hkv, s)))


def nan_as_0(*ts):
    return tuple(torch.nan_to_num(t, nan=0.0) for t in ts)


def routed():
    return sum(tfb.stats()["routed"].values())


@pytest.fixture
def cpu_routing():
    tfb.reset_stats()
    with testing.route_cpu():
        yield


# ------------------------------------------------------------------ CPU ops


@pytest.mark.parametrize("length,s", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_ops_match_reference(length, s, dtype):
    q, k, v = qkv(length=length, s=s, dtype=dtype)
    grad = torch.randn_like(q)
    out, lse = ops.fwd(q, k, v, None, True, bottom_right=True)
    dq, dk, dv = ops.bwd(grad, q, k, v, out, lse, None, True, bottom_right=True)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = lower_right_mask(length, s)
    ref_out, ref_lse = attention_ref(*leaves, attn_mask=mask)
    ref_grads = torch.autograd.grad(ref_out, leaves, grad.double())
    base = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base_out = F.scaled_dot_product_attention(*base, attn_mask=causal_lower_right(length, s), enable_gqa=True)
    # PyTorch's math path gives NaN for rows that see no key (and warns); its flash kernel 0, as ours.
    base_out, *base_grads = nan_as_0(base_out, *torch.autograd.grad(base_out, base, grad))
    floor = 1e-5 if dtype == torch.float32 else 1e-3
    assert_within_baseline("out", out, base_out, ref_out, floor=floor)
    for name, ours, b, r in zip(("dq", "dk", "dv"), (dq, dk, dv), base_grads, ref_grads):
        assert_within_baseline(name, ours, b, r, floor=floor)
    seen = torch.isfinite(ref_lse)
    assert max_err(lse[seen], ref_lse[seen]) <= 1e-5 * max(1.0, ref_lse[seen].abs().max().item())
    if length > s:  # rows before the diagonal: no key, output 0
        assert (~seen).any() and torch.equal(out[~seen], torch.zeros_like(out[~seen]))
        assert torch.isinf(lse[~seen]).all()


def test_top_left_is_the_default_and_differs():
    q, k, v = qkv(length=5, s=40)
    top_left = ops.fwd(q, k, v, None, True)[0]
    bottom_right = ops.fwd(q, k, v, None, True, bottom_right=True)[0]
    torch.testing.assert_close(top_left, attention_ref(q, k, v, is_causal=True)[0].float(), atol=1e-5, rtol=1e-5)
    assert max_err(top_left, bottom_right) > 0.1
    # Without is_causal it changes nothing.
    assert torch.equal(ops.fwd(q, k, v, None, False, bottom_right=True)[0], ops.fwd(q, k, v)[0])


@pytest.mark.parametrize("length,s", [(17, 40), (40, 17)])
def test_opcheck(length, s):
    q, k, v = qkv(length=length, s=s, requires_grad=True)
    torch.library.opcheck(ops.fwd.default, (q, k, v, None, True), {"bottom_right": True})
    out, lse = ops.fwd(q, k, v, None, True, bottom_right=True)
    grad = torch.randn_like(out)
    torch.library.opcheck(ops.bwd.default, (grad, *(t.detach() for t in (q, k, v)), out.detach(), lse, None, True),
                          {"bottom_right": True})


# ------------------------------------------------- routing, the functional entry


@pytest.mark.parametrize("length,s", [(17, 40), (40, 17)])
def test_enable_routes_causal_lower_right(cpu_routing, length, s):
    """Such calls bypass aten::scaled_dot_product_attention (CausalBias runs
    PyTorch's flash or efficient ops itself); enable() routes them, strict too."""
    q, k, v = qkv(length=length, s=s, requires_grad=True)
    bias = causal_lower_right(length, s)
    with tfb.enable(strict=True):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    assert tfb.stats()["routed"] == {"cpu_fwd_fp32_hdim32": 1}
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    assert routed() == 1  # outside enable(): PyTorch's own
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_enable_routes_square_and_upper_left_biases(cpu_routing):
    """An upper-left bias, or a lower-right one of equal lengths, is SDPA's is_causal."""
    q, k, v = qkv(length=40, s=40)
    with tfb.enable(strict=True):
        square = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(40, 40), enable_gqa=True)
        upper = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(40, 40), enable_gqa=True)
    assert routed() == 2
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(square, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(upper, want, atol=1e-5, rtol=1e-5)


def test_strict_names_the_reason(cpu_routing):
    q, k, v = qkv(length=17, s=40)
    with tfb.enable(strict=True), pytest.raises(tfb.UnsupportedError, match="dropout_p=0.5"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(17, 40), dropout_p=0.5, enable_gqa=True)
    with tfb.enable():  # not strict: PyTorch's own serves it
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(17, 40), dropout_p=0.5,
                                             enable_gqa=True)
    assert out.shape == q.shape and routed() == 0


def test_causal_bias_with_is_causal_raises(cpu_routing):
    q, k, v = qkv(length=17, s=40)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        tfb.flash_attn(q, k, v, attn_mask=causal_lower_right(17, 40), is_causal=True, enable_gqa=True)
    with tfb.enable(), pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(17, 40), is_causal=True,
                                       enable_gqa=True)


def test_explain_and_flash_attn(cpu_routing):
    q, k, v = qkv(length=17, s=40, requires_grad=True)
    bias = causal_lower_right(17, 40)
    decision = tfb.explain(q, k, v, attn_mask=bias, enable_gqa=True)
    assert decision.served and "causal (bottom-right)" in str(decision), decision
    assert "bottom-right" not in str(tfb.explain(q, k, v, attn_mask=causal_upper_left(17, 40), enable_gqa=True))
    out = tfb.flash_attn(q, k, v, attn_mask=bias, enable_gqa=True)
    ref, _ = attention_ref(q, k, v, attn_mask=lower_right_mask(17, 40))
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad.double())):
        torch.testing.assert_close(g, w.float(), atol=1e-4, rtol=1e-4)


def test_decision_is_cached_apart_from_top_left(cpu_routing):
    q, k, v = qkv(length=17, s=40)
    top = _router.decide(q, k, v, None, 0.0, True, None, True)
    bottom = _router.decide(q, k, v, None, 0.0, True, None, True, bottom_right=True)
    assert "bottom-right" in bottom.reason and "bottom-right" not in top.reason


class LowerRight(torch.nn.Module):
    """Dynamo cannot build a CausalBias inside a compiled region: it is made
    outside, as a model's constant or an input."""

    def __init__(self, length, s):
        super().__init__()
        self.bias = causal_lower_right(length, s)

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, enable_gqa=True)


def _bottom_right_of(node, position):
    return node.kwargs["bottom_right"] if "bottom_right" in node.kwargs else node.args[position]


def _nodes(graph, op):
    return [n for n in graph.nodes if str(n.target) == f"torch_flash_backend.{op}.default"]


def test_compiled(cpu_routing):
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    q, k, v = qkv(length=17, s=40, requires_grad=True)
    bias = causal_lower_right(17, 40)

    @torch.compile(backend=backend, fullgraph=True)
    def f(q, k, v, bias):
        with tfb.enable(strict=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    out = f(q, k, v, bias)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True),
                               atol=1e-5, rtol=1e-5)
    (node,) = _nodes(backend.fw_graphs[0].graph, "fwd")
    assert _bottom_right_of(node, 8) is True, backend.fw_graphs[0].code
    out.sum().backward()
    (node,) = _nodes(backend.bw_graphs[0].graph, "bwd")
    assert _bottom_right_of(node, 10) is True, backend.bw_graphs[0].code


def test_exported(cpu_routing):
    """Non-strict: strict export turns a CausalBias into a plain tensor, PyTorch's own SDPA included."""
    q, k, v = qkv(length=17, s=40)
    ep = torch.export.export(tfb.enable(strict=True)(LowerRight(17, 40)), (q, k, v), strict=False)
    (node,) = _nodes(ep.graph, "fwd")
    assert _bottom_right_of(node, 8) is True, ep.graph
    torch.testing.assert_close(ep.module()(q, k, v), LowerRight(17, 40)(q, k, v), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ CUDA kernels

CUDA_SHAPES = [(1, 129), (17, 1000), (127, 129), (129, 127), (1000, 17), (256, 1024)]


def poison(like):
    """NaN in the memory the next outputs will take (the caching allocator hands it back)."""
    torch.empty(like.numel() * 3 + 4096, device="cuda", dtype=like.dtype).fill_(float("nan"))


def _dtype_name(dtype):
    return "fp16" if dtype == torch.float16 else "bf16"


def _runs(family, pass_, dtype, e):
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        return False
    return f"{family}_{pass_}_{_dtype_name(dtype)}_hdim{e}" in tfb.built_kernels()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("length,s", CUDA_SHAPES)
@pytest.mark.parametrize("e", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_families_match_reference(family, length, s, e, dtype):
    """Forward and backward of each family, beside PyTorch's lower-right causal
    (its flash kernel) against float64."""
    if not _runs(family, "fwd", dtype, e):
        pytest.skip(f"no {family} forward for {dtype} head dim {e} here")
    q, k, v = qkv(hq=8, hkv=2, length=length, s=s, e=e, dtype=dtype, device="cuda", seed=length * 7 + s)
    grad = torch.randn_like(q)
    poison(q)
    out, lse = ops.fwd(q, k, v, None, True, family, bottom_right=True)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, attn_mask=lower_right_mask(length, s, "cuda"))
    base = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base_out = F.scaled_dot_product_attention(*base, attn_mask=causal_lower_right(length, s), enable_gqa=True)
    assert_within_baseline(f"{family} out", out, nan_as_0(base_out)[0], ref_out)
    seen = torch.isfinite(ref_lse)
    assert max_err(lse[seen], ref_lse[seen]) <= 1e-3
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    if not _runs(family, "bwd", dtype, e):
        return
    dq, dk, dv = ops.bwd(grad, q, k, v, out, lse, None, True, family, bottom_right=True)
    ref_grads = torch.autograd.grad(ref_out, leaves, grad.double())
    base_grads = nan_as_0(*torch.autograd.grad(base_out, base, grad))
    for name, ours, b, r in zip(("dq", "dk", "dv"), (dq, dk, dv), base_grads, ref_grads):
        assert_within_baseline(f"{family} {name}", ours, b, r, floor=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("length,s", [(2, 1000), (16, 300), (4, 3)])
def test_cuda_decode_matches_reference(length, s):
    if "decode_fwd_bf16_hdim128" not in tfb.built_kernels():
        pytest.skip("no decode kernel built")
    q, k, v = qkv(hq=8, hkv=2, length=length, s=s, e=128, dtype=torch.bfloat16, device="cuda")
    poison(q)
    out = ops.fwd(q, k, v, None, True, "decode", bottom_right=True)[0]
    ref, _ = attention_ref(q, k, v, attn_mask=lower_right_mask(length, s, "cuda"))
    base = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(length, s), enable_gqa=True)
    assert_within_baseline("decode out", out, nan_as_0(base)[0], ref)


@pytest.mark.gpu
def test_cuda_enable_serves_lower_right():
    q, k, v = qkv(hq=8, hkv=2, length=256, s=1024, e=128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    bias = causal_lower_right(256, 1024)
    tfb.reset_stats()
    with tfb.enable(strict=True):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    assert routed() == 1, tfb.stats()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, w, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_cuda_provider_serves_lower_right():
    """PyTorch's flash ops align is_causal bottom-right; the provider now serves L != S."""
    import torch.nn.attention as A
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = qkv(hq=8, hkv=8, length=256, s=1024, e=128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    bias = causal_lower_right(256, 1024)
    tfb.reset_stats()
    A.activate_flash_attention_impl("torch_flash_backend")
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        A.restore_flash_attention_impl()
    assert routed() == 2, tfb.stats()  # forward and backward
    ours = tfb.flash_attn(q, k, v, attn_mask=bias)
    assert torch.equal(out, ours)
    for g, w in zip(grads, torch.autograd.grad(ours, (q, k, v), torch.ones_like(out))):
        torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2)
