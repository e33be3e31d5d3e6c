"""Dropout on P (SDPA's dropout_p) in the sm90 and sm80 kernels: the ops
dropout_fwd / dropout_bwd / dropout_mask, the router, flash_attn and enable().

The kernels' mask is checked three ways: against dropout_mask (one-hot values
and gradients expose the pairs each pass kept), against a float64 reference
built from that mask (error at most 2x PyTorch's math path with the same mask
in the inputs' dtype), and statistically (the kept fraction; the mean over many
masks is attention without dropout)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_flash_backend as tfb
from torch_flash_backend import _router, testing
from reference import assert_within_baseline, attention_ref, max_err

ops = torch.ops.torch_flash_backend
FAMILIES = ["sm90", "sm80"]


def _runs_here(family, head_dim=128, dtype=torch.bfloat16):
    if not torch.cuda.is_available():
        return False
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    built = tfb.built_kernels()
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        return False
    return f"{family}_fwd_{name}_hdim{head_dim}" in built and f"{family}_bwd_{name}_hdim{head_dim}" in built


def _need(family, head_dim=128, dtype=torch.bfloat16):
    if not _runs_here(family, head_dim, dtype):
        pytest.skip(f"no {family} kernels of head dim {head_dim} run here")


def _math(q, k, v, kept, p, scale, causal, dtype, visible=None):
    """PyTorch's math path with the given dropout mask, in `dtype` (float64: the
    reference; a 16-bit dtype: the baseline, its softmax and P in that dtype as
    a fused kernel's P is, not upcast to float32). visible: a boolean mask (True:
    take part), given to the math op as the additive mask it adds."""
    gqa = q.size(1) != k.size(1)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    additive = None
    if visible is not None:
        additive = torch.zeros(visible.shape, dtype=dtype, device=q.device).masked_fill(~visible, float("-inf"))
    upcast = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, additive, p, causal, kept, scale=scale,
                                                                  enable_gqa=gqa)[0]
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(upcast)


# ---------------------------------------------------------------------------
# CPU: arguments, fake kernels, the router's reasons


def test_flash_attn_dropout_arguments():
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(ValueError, match="dropout_p must be a float in \\[0, 1\\)"):
        tfb.flash_attn(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="dropout_p"):
        tfb.flash_attn(q, q, q, dropout_p=-0.1)
    with pytest.raises(NotImplementedError, match="CPU ops draw no dropout"):
        tfb.flash_attn(q, q, q, dropout_p=0.1)


def test_explain_dropout_on_cpu_falls_back():
    q = torch.randn(1, 2, 32, 64, dtype=torch.bfloat16)
    with testing.route_cpu():
        assert tfb.explain(q, q, q).served
        decision = tfb.explain(q, q, q, dropout_p=0.2)
    assert not decision.served and "CPU ops draw no dropout" in decision.reason, decision


def test_router_sends_dropout_to_the_families_that_draw_it():
    """The registry's dropout column: sm90 and sm80 draw it, decode does not, so
    a short query with dropout runs a tiled kernel; packed batches fall back."""
    kernels = testing.registry_kernel_names()
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=kernels):
        q = torch.empty(2, 8, 512, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        d = tfb.explain(q, q, q, dropout_p=0.1, is_causal=True)
        assert d.served and d.kernel == "sm90_fwd_bf16_hdim128" and d.backward_family == "sm90", d
        assert "dropout 0.1" in d.reason
        short = q[:, :, :4]
        assert tfb.explain(short, q, q).kernel.startswith("decode")
        d = tfb.explain(short, q, q, dropout_p=0.1)
        assert d.served and d.family == "sm90", d
        for p in (1.0, -0.5):
            d = tfb.explain(q, q, q, dropout_p=p)
            assert not d.served and "outside (0, 1)" in d.reason, d
        mask = torch.empty(512, 512, dtype=torch.bool, device="cuda")
        d = tfb.explain(q, q, q, attn_mask=mask, dropout_p=0.1)
        assert not d.served and "with attn_mask" in d.reason, d
        d = _router.decide(q, q, q, None, 0.1, True, None, False, bottom_right=True, window=(16, 0))
        assert d.served and d.family == "sm90", d  # a window is two edges: drawn beside them
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=testing.registry_kernel_names("decode")):
        q = torch.empty(2, 8, 4, 128, dtype=torch.bfloat16, device="cuda")
        d = tfb.explain(q, q, q, dropout_p=0.1)
        assert not d.served and "draws dropout" in d.reason, d
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=kernels):
        q = torch.empty(100, 8, 128, dtype=torch.bfloat16, device="cuda")
        cu = torch.tensor([0, 40, 100], dtype=torch.int32, device="cuda")
        assert _router.decide_varlen(q, q, q, cu, cu, 60, 60, pinned=True).served
        d = _router.decide_varlen(q, q, q, cu, cu, 60, 60, 0.1, pinned=True)
        assert not d.served and "packed ops draw no dropout" in d.reason, d


@pytest.mark.parametrize("p", [0.0, 1.0, 1.5, -0.2])
def test_fake_kernels_check_p(p):
    with FakeTensorMode():
        q = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="dropout_p must be in \\(0, 1\\)"):
            ops.dropout_fwd(q, q, q, p)


def test_fake_kernels_shapes():
    with FakeTensorMode():
        q = torch.empty(2, 16, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.empty(2, 2, 40, 64, dtype=torch.bfloat16)
        v = torch.empty(2, 2, 40, 32, dtype=torch.bfloat16)
        out, lse, rng = ops.dropout_fwd(q, k, v, 0.1, None, True)
        assert out.shape == (2, 4, 16, 32) and lse.shape == (2, 4, 16) and rng.shape == (2,)
        assert rng.dtype == torch.int64
        dq, dk, dv = ops.dropout_bwd(out, q, k, v, out, lse, rng, 0.1)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        kept = ops.dropout_mask(rng, 0.1, 2, 4, 16, 40)
        assert kept.shape == (2, 4, 16, 40) and kept.dtype == torch.bool


# ---------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_p_moves_in_steps_of_a_256th():
    """A pair is kept when its 8-bit draw reaches round(p * 256): two p
    that round alike drop the same pairs; one step more drops a subset's
    complement, never a pair the smaller p kept."""
    _need("sm80")
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    _, _, rng = ops.dropout_fwd(q, q, q, 0.1, None, False, "sm80", "sm80")
    step = 1 / 256
    base = round(0.1 * 256) * step
    a = ops.dropout_mask(rng, base, 1, 2, 512, 512)
    b = ops.dropout_mask(rng, base + 0.3 * step, 1, 2, 512, 512)
    c = ops.dropout_mask(rng, base + step, 1, 2, 512, 512)
    assert torch.equal(a, b)
    assert not (c & ~a).any() and (a & ~c).any()


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction(p):
    _need("sm80")
    q = torch.randn(4, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
    _, _, rng = ops.dropout_fwd(q, q, q, p, None, False, "sm80", "sm80")
    kept = ops.dropout_mask(rng, p, 4, 8, 2048, 2048)
    frac = kept.float().mean().item()
    assert abs(frac - (1 - p)) < 0.005, frac
    # Heads, batches, rows and columns draw apart.
    assert (kept[0, 0] != kept[0, 1]).float().mean() > 0.9 * 2 * p * (1 - p)
    assert (kept[0, 0] != kept[1, 0]).float().mean() > 0.9 * 2 * p * (1 - p)
    assert (kept[0, 0, 0] != kept[0, 0, 1]).float().mean() > 0.5 * 2 * p * (1 - p)
    per_col = kept[..., :32].float().mean(dim=(0, 1, 2))  # each key position of a cell's two 16-key blocks
    assert (per_col - (1 - p)).abs().max() < 0.01, per_col


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_passes_apply_the_returned_mask(family, causal):
    """V = I makes out's row i P's row i times its kept pairs; dO = I makes dV^T
    the same for the backward: both must be dropout_mask's pairs exactly."""
    _need(family)
    torch.manual_seed(1)
    b, h, n, e, p = 2, 3, 128, 128, 0.3
    q = (torch.randn(b, h, n, e, device="cuda") * 0.3).to(torch.bfloat16).requires_grad_()
    k = (torch.randn(b, h, n, e, device="cuda") * 0.3).to(torch.bfloat16).requires_grad_()
    eye = torch.eye(n, e, device="cuda", dtype=torch.bfloat16).expand(b, h, n, e).contiguous()
    v = eye.clone().requires_grad_()
    out, lse, rng = ops.dropout_fwd(q, k, v, p, None, causal, family, family)
    kept = ops.dropout_mask(rng, p, b, h, n, n)
    visible = torch.ones(n, n, device="cuda", dtype=torch.bool)
    if causal:
        visible = visible.tril()
    assert torch.equal(out.float() != 0, kept & visible)
    dq, dk, dv = ops.dropout_bwd(eye, q, k, v, out, lse, rng, p, None, causal, family)
    assert torch.equal(dv.float().transpose(-1, -2) != 0, kept & visible)


CASES = [  # (b, hq, hkv, L, S, causal, scale)
    (2, 4, 4, 128, 128, True, None),
    (1, 4, 2, 127, 129, False, None),
    (1, 2, 2, 1000, 333, False, 0.3),
    (1, 8, 2, 333, 1000, True, None),
    (2, 2, 1, 17, 300, False, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_h{}-{}_L{}_S{}_{}_s{}".format(
    *c[:5], "causal" if c[5] else "full", c[6]))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_reference_with_its_mask(family, head_dim, case):
    _need(family, head_dim)
    b, hq, hkv, L, S, causal, scale = case
    torch.manual_seed(hash((head_dim, L, S, hq, causal)) % 2**31)
    p = 0.2
    q = torch.randn(b, hq, L, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, S, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, S, head_dim, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(b, hq, L, head_dim, device="cuda", dtype=torch.bfloat16)
    out, lse, rng = ops.dropout_fwd(q, k, v, p, scale, causal, family, family)
    kept = ops.dropout_mask(rng, p, b, hq, L, S)
    dq, dk, dv = ops.dropout_bwd(dout, q, k, v, out, lse, rng, p, scale, causal, family)

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64 = _math(q64, k64, v64, kept, p, scale, causal, torch.float64)
    ref = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    outb = _math(qb, kb, vb, kept, p, scale, causal, torch.bfloat16)
    base = torch.autograd.grad(outb, (qb, kb, vb), dout)
    assert_within_baseline(f"{family} out", out, outb, out64, floor=1e-4)
    _, lse64 = attention_ref(q, k, v, scale, causal)
    assert max_err(lse, lse64) < 1e-3  # lse is dropout's untouched softmax's
    for name, o, bl, r in zip(("dq", "dk", "dv"), (dq, dk, dv), base, ref):
        assert_within_baseline(f"{family} {name}", o, bl, r, floor=1e-4)


WINDOWS = [  # (L, S, head_dim, window_left, window_right, is_causal, bottom_right)
    (256, 256, 128, 64, -1, True, True),
    (256, 256, 128, 64, 32, False, True),
    (300, 500, 64, 100, 20, False, True),
    (256, 256, 128, -1, 0, False, False),
    (200, 130, 64, 17, 5, False, True),  # L > S: the first rows see no key
    (129, 700, 128, 1, 1, False, False),  # three keys a row, top-left
]
# (A band of one key a row is left out: there P = 1, so dS = P (dP - D) is exactly 0
# in the math path, while a flash backward takes D from the rounded O and leaves
# dq, dk of the rounding's size, ~2e-2 here, with or without dropout.)


@pytest.mark.gpu
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: "L{}_S{}_E{}_left{}_right{}_causal{}_br{}".format(*w))
@pytest.mark.parametrize("family", FAMILIES)
def test_window_matches_reference_with_its_mask(family, window):
    """A window is two edges the kernels walk; the draws beside it are the
    call's mask, as beside is_causal (rows that see no key give 0)."""
    L, S, head_dim, left, right, causal, bottom_right = window
    _need(family, head_dim)
    from test_windows import band_mask
    torch.manual_seed(L * 7 + S + left)
    b, hq, hkv, p = 2, 4, 2, 0.2
    q = torch.randn(b, hq, L, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, S, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, S, head_dim, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(b, hq, L, head_dim, device="cuda", dtype=torch.bfloat16)
    band = dict(bottom_right=bottom_right, window_left=left, window_right=right)
    out, lse, rng = ops.dropout_fwd(q, k, v, p, None, causal, family, family, **band)
    kept = ops.dropout_mask(rng, p, b, hq, L, S)
    dq, dk, dv = ops.dropout_bwd(dout, q, k, v, out, lse, rng, p, None, causal, family, **band)
    visible = band_mask(L, S, left, right, causal, bottom_right, "cuda")
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64 = _math(q64, k64, v64, kept, p, None, False, torch.float64, visible)
    ref = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    outb = _math(qb, kb, vb, kept, p, None, False, torch.bfloat16, visible)
    base = torch.autograd.grad(outb, (qb, kb, vb), dout)
    name = f"{family} window {window}"
    assert_within_baseline(f"{name} out", out, outb, out64, floor=1e-4)
    for what, o, bl, r in zip(("dq", "dk", "dv"), (dq, dk, dv), base, ref):
        assert_within_baseline(f"{name} {what}", o, bl, r, floor=1e-4)


@pytest.mark.gpu
def test_dropout_beside_a_mask_is_refused():
    family = "sm90" if _runs_here("sm90") else "sm80"
    _need(family)
    q = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(64, 64, device="cuda") > 0.5
    with pytest.raises(RuntimeError, match="dropout_p > 0 with attn_mask"):
        ops.dropout_fwd(q, q, q, 0.1, None, False, family, family, attn_mask=mask)
    with tfb.enable():
        assert "with attn_mask" in tfb.explain(q, q, q, attn_mask=mask, dropout_p=0.1).reason
        torch.manual_seed(0)
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=0.1)  # PyTorch's kernel
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_mean_over_masks_is_attention(family):
    _need(family, 64)
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    p, draws = 0.3, 400
    total = torch.zeros(1, 2, 64, 64, device="cuda", dtype=torch.float64)
    sq = torch.zeros_like(total)
    for _ in range(draws):
        o = ops.dropout_fwd(q, k, v, p, None, False, family, family)[0].double()
        total += o
        sq += o * o
    mean = total / draws
    std_of_mean = ((sq / draws - mean * mean).clamp_min(0) / draws).sqrt()
    ref, _ = attention_ref(q, k, v)
    z = (mean - ref).abs() / (std_of_mean + 1e-3)
    assert z.mean() < 1.2 and z.max() < 6, (z.mean().item(), z.max().item())


@pytest.mark.gpu
def test_seed_reproduces_and_calls_differ():
    family = "sm90" if _runs_here("sm90") else "sm80"
    _need(family)

    def run(seed):
        torch.manual_seed(seed)
        q, k, v = (torch.randn(2, 4, 200, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        o = tfb.flash_attn(q, k, v, dropout_p=0.25, is_causal=True)
        o.backward(torch.ones_like(o))
        return o, q.grad, k.grad, v.grad

    a, b = run(0), run(0)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 200, 128, device="cuda", dtype=torch.bfloat16)
    o1, o2 = tfb.flash_attn(q, q, q, dropout_p=0.25), tfb.flash_attn(q, q, q, dropout_p=0.25)
    assert not torch.equal(o1, o2)


@pytest.mark.gpu
def test_cuda_graph_replays_draw_new_masks():
    family = "sm90" if _runs_here("sm90") else "sm80"
    _need(family)
    q = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    static_out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        static_out.copy_(ops.dropout_fwd(q, q, q, 0.5, None, False, family, family)[0])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, rng = ops.dropout_fwd(q, q, q, 0.5, None, False, family, family)
        static_out.copy_(out)
    graph.replay()
    first, first_rng = static_out.clone(), rng.clone()
    graph.replay()
    assert not torch.equal(first, static_out)
    assert not torch.equal(first_rng, rng)
    # A replay's rng_state names its draws: its mask reproduces what it kept.
    kept = ops.dropout_mask(rng, 0.5, 1, 2, 256, 256)
    ref = _math(q, q, q, kept, 0.5, None, False, torch.float64)
    assert_within_baseline("replay", static_out, _math(q, q, q, kept, 0.5, None, False, torch.bfloat16), ref,
                           floor=1e-4)


@pytest.mark.gpu
def test_opcheck_dropout_ops():
    family = "sm90" if _runs_here("sm90") else "sm80"
    _need(family)
    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 80, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # The outputs are random: the checks that compare two runs' values are left out.
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.dropout_fwd.default, (q, k, k, 0.1, None, True, family, family), test_utils=utils)
    out, lse, rng = ops.dropout_fwd(q, k, k, 0.1, None, True, family, family)
    torch.library.opcheck(ops.dropout_bwd.default, (out.detach(), q, k, k, out.detach(), lse, rng, 0.1, None, True,
                                                    family), test_utils=utils)
    torch.library.opcheck(ops.dropout_mask.default, (rng, 0.1, 1, 4, 64, 80))


@pytest.mark.gpu
def test_enable_serves_sdpa_dropout():
    family = "sm90" if _runs_here("sm90") else "sm80"
    _need(family)
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    tfb.reset_stats()
    with tfb.enable(strict=True):
        decision = tfb.explain(q, k, k, dropout_p=0.1, is_causal=True, enable_gqa=True)
        assert decision.served and "dropout 0.1" in decision.reason, decision
        torch.manual_seed(5)
        o = F.scaled_dot_product_attention(q, k, k, dropout_p=0.1, is_causal=True, enable_gqa=True)
        o.sum().backward()
    assert sum(tfb.stats()["routed"].values()) == 1
    assert all(torch.isfinite(t).all() for t in (o, q.grad, k.grad))
    # A short query goes to a family that draws dropout, not to the decode family.
    with tfb.enable(strict=True):
        d = tfb.explain(q[:, :, :1], k, k, dropout_p=0.1, enable_gqa=True)
    assert d.served and not d.kernel.startswith("decode"), d


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_nan_reaches_the_rows_that_see_it(family):
    """A NaN key makes every row that sees it NaN, as PyTorch's math path does,
    whether dropout kept or dropped that pair; the other rows stay finite."""
    _need(family, 64)
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k[0, 0, 50] = float("nan")
    out, lse, rng = ops.dropout_fwd(q, k, v, 0.9, None, True, family, family)
    assert torch.isnan(out[0, 0, 50:]).all() and torch.isfinite(out[0, 0, :50]).all()
    assert torch.isfinite(out[0, 1]).all()


@pytest.mark.gpu
def test_provider_serves_dropout_with_its_debug_mask():
    """PyTorch's flash ops through the provider hook: dropout served by our
    kernels, return_debug_mask in PyTorch's encoding (dropped pairs negative),
    the backward regenerating the forward's mask, seeds reproducing."""
    import torch.nn.attention as A
    from torch.nn.attention import SDPBackend, sdpa_kernel

    family = "sm90" if _runs_here("sm90") else "sm80"
    _need(family)
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    A.activate_flash_attention_impl("torch_flash_backend")
    try:
        tfb.reset_stats()
        out, _, _, _, _, _, seed, _, debug = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.2, False, True)
        kept = debug >= 0
        assert torch.equal(kept, ops.dropout_mask(seed.view(torch.int64), 0.2, 2, 4, 256, 256))
        assert 0.78 < kept.float().mean().item() < 0.82
        grads = torch.autograd.grad(out, (q, k, v), dout)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref_out = _math(q64, k64, v64, kept, 0.2, None, False, torch.float64)
        ref = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())
        qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
        base_out = _math(qb, kb, vb, kept, 0.2, None, False, torch.bfloat16)
        base = torch.autograd.grad(base_out, (qb, kb, vb), dout)
        assert_within_baseline("provider out", out, base_out, ref_out, floor=1e-4)
        for name, o, bl, r in zip(("dq", "dk", "dv"), grads, base, ref):
            assert_within_baseline(f"provider {name}", o, bl, r, floor=1e-4)
        routed = tfb.stats()["routed"]
        assert any(n.startswith(f"{family}_fwd") for n in routed) and any(
            n.startswith(f"{family}_bwd") for n in routed), routed

        def sdpa(seed_):
            torch.manual_seed(seed_)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
            return (o, *torch.autograd.grad(o, (q, k, v), dout))

        for a, b in zip(sdpa(7), sdpa(7)):
            assert torch.equal(a, b)
    finally:
        A.restore_flash_attention_impl()


@pytest.mark.gpu
def test_provider_serves_dropout_beside_a_window():
    """PyTorch's _flash_attention_forward with window_size_left / right and
    dropout: our kernels draw beside the window (bottom-right, as PyTorch's
    kernel aligns it), and its debug mask rebuilds the output."""
    import torch.nn.attention as A

    from test_windows import band_mask

    family = "sm90" if _runs_here("sm90") else "sm80"
    _need(family)
    torch.manual_seed(8)
    L, S, left, right, p = 256, 320, 48, 16, 0.2
    q = torch.randn(2, L, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, S, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    A.activate_flash_attention_impl("torch_flash_backend")
    try:
        tfb.reset_stats()
        out, _, _, _, debug = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, L, S, p, False, True, window_size_left=left, window_size_right=right)
        routed = tfb.stats()["routed"]
    finally:
        A.restore_flash_attention_impl()
    assert any(n.startswith(f"{family}_fwd") for n in routed), routed
    kept = debug >= 0
    visible = band_mask(L, S, left, right, False, True, "cuda")
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))
    ref = _math(q4.double(), k4.double(), v4.double(), kept, p, None, False, torch.float64, visible)
    base = _math(q4, k4, v4, kept, p, None, False, torch.bfloat16, visible)
    assert_within_baseline("provider window out", out.transpose(1, 2), base, ref, floor=1e-4)


@pytest.mark.gpu
def test_compiled_and_exported_calls_draw_as_eager():
    """torch.compile(fullgraph=True) and torch.export of SDPA with dropout
    inside enable(): the graphs call our dropout op, and with the same seed
    they draw eager's mask (outputs and gradients bit for bit)."""
    family = "sm90" if _runs_here("sm90", 64) else "sm80"
    _need(family, 64)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16)

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)

    def run(fn):
        torch.manual_seed(3)
        out = fn(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    with tfb.enable():
        eager = run(Attend())
    compiled = run(torch.compile(tfb.enable()(Attend()), fullgraph=True))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    ep = torch.export.export(tfb.enable(strict=True)(Attend()), (q, k, v))
    targets = {str(n.target) for n in ep.graph.nodes}
    assert "torch_flash_backend.dropout_fwd.default" in targets, targets
    torch.manual_seed(3)
    assert torch.equal(ep.module()(q, k, v), eager[0])
