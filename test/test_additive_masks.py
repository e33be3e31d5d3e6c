"""Additive attn_mask (float values added to the scaled scores, -inf hides), in
q's dtype or float32, as SDPA takes it: the CPU ops, enable(), explain() and
flash_attn, then every CUDA family against the float64 reference.

The pre-pass sorts each tile as all visible (every value 0), all hidden (every
value -inf), mixed (0 and -inf alone: read as bits), floored (0 and values
beyond -65536 alone: bits, the others' logit the limit) or additive (any other
value: read per score); the masks here hold all five kinds. A mask of
finfo.min values (Hugging Face's padding) leaves rows it covers entirely with
uniform weights, as PyTorch's SDPA gives; rows of -inf give 0, as a boolean
mask's. A mask that requires grad falls back (the kernels give it no gradient).
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_flash_backend as tfb
from torch_flash_backend import _router, testing

import reference
from reference import assert_within_baseline, attention_ref, max_err, stable_seed

ops = torch.ops.torch_flash_backend
NEG_INF = float("-inf")
LIMIT = reference.ADDITIVE_LIMIT


def make_mask(kind, b, hq, length, s, dtype, device="cpu", seed=0):
    """Additive masks in `dtype`, (B or 1, H or 1, L, S)."""
    g = torch.Generator().manual_seed(seed * 7919 + b * 31 + length * 17 + s)
    if kind == "bias":  # finite values everywhere: every tile reads them
        mask = torch.randn(b, hq, length, s, generator=g) * 3
    elif kind == "kinds":  # 64 x 64 blocks of each tile kind: 0, -inf, 0 and -inf, finite values,
        # -1e30 (beyond the limit: floored), 0 and -1e30 (float16 holds -1e30 as -inf)
        pick = torch.randint(0, 6, (b, hq, (length + 63) // 64, (s + 63) // 64), generator=g)
        pick = pick.repeat_interleave(64, 2).repeat_interleave(64, 3)[:, :, :length, :s]
        values = torch.randn(b, hq, length, s, generator=g)
        holes = torch.rand(b, hq, length, s, generator=g) > 0.5
        mask = torch.zeros(b, hq, length, s)
        mask[pick == 1] = NEG_INF
        mask[(pick == 2) & holes] = NEG_INF
        mask[pick == 3] = values[pick == 3]
        mask[pick == 4] = -1e30
        mask[(pick == 5) & holes] = -1e30
        mask[..., 0] = values[..., 0]  # every row sees a key short of the limit (min-kind rows test the others)
        mask[..., length // 2, :] = NEG_INF  # a row that sees nothing
    elif kind == "min":  # Hugging Face's padding: the dtype's lowest value on each batch row's padded keys
        valid = torch.randint(1, s + 1, (b,), generator=g)
        valid[0] = 0  # a batch row with no valid key: uniform weights
        mask = torch.zeros(b, 1, 1, s).masked_fill(torch.arange(s)[None, None, None] >= valid[:, None, None, None],
                                                   torch.finfo(dtype).min)
    elif kind == "alibi":  # a slope per head times the distance, broadcast over batch
        slopes = 2.0 ** -torch.arange(1, hq + 1, dtype=torch.float32)
        distance = (torch.arange(s)[None, :] - torch.arange(length)[:, None]).abs().float()
        mask = -(slopes[:, None, None] * distance)[None]
    else:
        raise ValueError(kind)
    return mask.to(dtype).to(device)


def qkv(b, hq, hkv, length, s, e, dtype, device="cpu", seed=0, requires_grad=False):
    torch.manual_seed(seed)
    return tuple(torch.randn(b, n, h, e, dtype=dtype, device=device).transpose(1, 2).requires_grad_(requires_grad)
                 for h, n in ((hq, length), (hkv, s), (hkv, s)))


def math_sdpa(q, k, v, mask, scale=None, grads_of=None, dout=None):
    """PyTorch's math SDPA in the input dtype, NaN (rows of -inf) as 0."""
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.size(1) != k.size(1))
    if grads_of is None:
        return out.nan_to_num(0.0)
    return [g.nan_to_num(0.0) for g in torch.autograd.grad(out, grads_of, dout)]


def efficient_grads(q, k, v, mask, scale, dout):
    """PyTorch's efficient backend's gradients, which round dS as the tiled
    kernels do (the math backend keeps more precision): the mask copied into
    rows padded to 16 keys (its alignment), K/V repeated for GQA."""
    s, group = mask.size(-1), q.size(1) // k.size(1)
    full = mask.expand(q.size(0), q.size(1), q.size(2), s)
    padded = torch.zeros(*full.shape[:-1], (s + 15) // 16 * 16, device=q.device, dtype=q.dtype)[..., :s]
    padded.copy_(full)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(group, 1) for t in leaves[1:])
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = F.scaled_dot_product_attention(leaves[0], kk, vv, attn_mask=padded, scale=scale)
    return [g.nan_to_num(0.0) for g in torch.autograd.grad(out, leaves, dout)]


def check_ops(q, k, v, mask, name, family=None, backward=True, scale=None):
    """fwd (and bwd on the reference's out and lse) against float64, within 2x
    PyTorch's math SDPA in the same dtype."""
    dout = torch.randn_like(q)
    out, lse = ops.fwd(q, k, v, scale, False, family, attn_mask=mask)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*leaves, scale=scale, attn_mask=mask)
    assert_within_baseline(f"{name} out", out, math_sdpa(q, k, v, mask, scale), ref)
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all() and torch.isinf(lse[empty]).all(), f"{name}: rows that see no key"
    # Relative: rows whose every value lies beyond the limit have lse -65536 + log(S).
    seen = ~empty
    assert ((lse[seen] - ref_lse[seen]).abs() <= 1e-3 * ref_lse[seen].abs().clamp(min=1.0)).all(), f"{name}: lse"
    full = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2)).float()
    replaced = (torch.isfinite(full) & (full.abs() > LIMIT)).all(-1)
    if not backward:
        return
    grads = torch.autograd.grad(ref, leaves, dout.double())
    ours = ops.bwd(dout, q, k, v, ref.detach().to(q.dtype), ref_lse.detach().float().contiguous(), scale, False,
                   None if family is None else "sm80", attn_mask=mask)
    runs = [math_sdpa(*leaves, mask, scale, grads_of=leaves, dout=dout)
            for leaves in [[t.detach().clone().requires_grad_() for t in (q, k, v)]]]
    if q.is_cuda and mask.dtype == q.dtype:
        runs.append(efficient_grads(q, k, v, mask, scale, dout))
    # A batch row whose every value lies beyond the limit: its lse, near -65536,
    # holds log(S) to float32's 2^-7 there, so its weights (and dv) to about 2^-7.
    far = replaced.flatten(1).all(1)
    for i, (what, o, r) in enumerate(zip(("dq", "dk", "dv"), ours, grads)):
        worst = max((run[i] for run in runs), key=lambda g: max_err(g, r))
        # Without the efficient baseline, which rounds O as the backward is given
        # it here, D = rowsum(dO * O) carries O's 16-bit rounding: a unit in the
        # last place of the largest gradient.
        floor = 1e-4 if len(runs) > 1 or q.dtype == torch.float32 else 2.0**-8 * r.abs().max().item()
        assert_within_baseline(f"{name} {what}", o[~far], worst[~far], r[~far], floor=max(floor, 1e-4))
        if far.any():
            assert max_err(o[far], r[far]) <= 2.0**-7 * r[far].abs().max().item() + 1e-4, f"{name} {what}: far rows"
    assert (ours[0][empty] == 0).all(), f"{name}: dq of rows that see no key"


# ------------------------------------------------------------------ CPU ops


@pytest.fixture
def cpu_routing():
    tfb.reset_stats()
    with testing.route_cpu():
        yield

CPU_CASES = [  # (B, Hq, Hkv, L, S, mask kind, q dtype, mask dtype)
    (2, 4, 2, 19, 70, "bias", torch.float32, torch.float32),
    (2, 4, 4, 130, 70, "kinds", torch.float32, torch.float32),
    (2, 4, 2, 33, 50, "min", torch.float32, torch.float32),
    (1, 4, 1, 40, 40, "alibi", torch.float32, torch.float32),
    (2, 4, 2, 33, 50, "kinds", torch.bfloat16, torch.bfloat16),
    (2, 4, 2, 33, 50, "bias", torch.bfloat16, torch.float32),
    (2, 2, 2, 20, 37, "min", torch.float16, torch.float16),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"L{c[3]}-S{c[4]}-{c[5]}-{c[6]}-mask_{c[7]}".replace("torch.", ""))
def test_cpu_ops_match_reference(case):
    b, hq, hkv, length, s, kind, dtype, mask_dtype = case
    q, k, v = qkv(b, hq, hkv, length, s, 32, dtype)
    mask = make_mask(kind, b, hq, length, s, mask_dtype)
    check_ops(q, k, v, mask, f"cpu {case}")


def test_cpu_negative_scale():
    """scale < 0 flips which score is largest; the value still joins scale q.k."""
    q, k, v = qkv(2, 2, 2, 30, 45, 16, torch.float32)
    check_ops(q, k, v, make_mask("kinds", 2, 2, 30, 45, torch.float32), "negative scale", scale=-0.3)


def test_min_rows_are_uniform():
    """A batch row whose every key carries finfo.min attends uniformly, as PyTorch's SDPA."""
    q, k, v = qkv(2, 2, 2, 8, 16, 16, torch.float32)
    mask = torch.zeros(2, 1, 1, 16)
    mask[0] = torch.finfo(torch.float32).min
    out, _ = ops.fwd(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out[0], v[0].mean(dim=1, keepdim=True).expand(2, 8, 16), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-5, rtol=1e-5)


def test_expanded_mask_is_read_in_place():
    """An expand()ed mask (stride 0) gives what its dense copy gives."""
    q, k, v = qkv(2, 4, 2, 21, 33, 16, torch.float32)
    row = make_mask("bias", 2, 1, 1, 33, torch.float32)
    out, _ = ops.fwd(q, k, v, attn_mask=row.expand(2, 4, 21, 33))
    dense, _ = ops.fwd(q, k, v, attn_mask=row.expand(2, 4, 21, 33).contiguous())
    assert torch.equal(out, dense)


def test_scale_zero_is_refused(cpu_routing):
    q, k, v = qkv(1, 2, 2, 40, 40, 16, torch.float32)
    mask = torch.zeros(40, 40)
    for scale in (0.0, 1e-31, -1e-31):
        with pytest.raises(RuntimeError, match=r"needs \|scale\| >= 1e-30"):
            ops.fwd(q, k, v, scale, attn_mask=mask)
        assert "needs |scale| >= 1e-30" in tfb.explain(q, k, v, attn_mask=mask, scale=scale).reason
    ops.fwd(q, k, v, 1e-30, attn_mask=mask)
    ops.fwd(q, k, v, 0.0, attn_mask=mask > 0)  # a boolean mask with scale 0 is fine


def test_enable_serves_additive_masks(cpu_routing):
    q, k, v = qkv(2, 4, 2, 33, 50, 32, torch.float32, requires_grad=True)
    mask = make_mask("kinds", 2, 4, 33, 50, torch.float32)
    with tfb.enable(strict=True):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.sum().backward()
    assert sum(tfb.stats()["routed"].values()) == 1
    grads = [t.grad for t in (q, k, v)]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    want.sum().backward()
    torch.testing.assert_close(out, want.nan_to_num(0.0), atol=2e-5, rtol=2e-5)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad.nan_to_num(0.0), atol=2e-5, rtol=2e-5)
    decision = tfb.explain(q, k, v, attn_mask=mask, enable_gqa=True)
    assert decision.served and "additive attn_mask (fp32)" in decision.reason


def test_scale_zero_after_a_cached_decision(cpu_routing):
    """enable()'s decision cache holds no scale: a call with scale=0 after served
    ones of the same metadata still falls back, with its reason."""
    q, k, v = qkv(1, 2, 2, 40, 40, 16, torch.float32)
    mask = torch.randn(40, 40)
    with tfb.enable():
        for _ in range(2):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.0)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.0))
    assert sum(tfb.stats()["routed"].values()) == 2
    assert tfb.stats()["fallback"] == {"an additive attn_mask needs |scale| >= 1e-30, got scale=0.0": 1}


def test_mask_that_requires_grad(cpu_routing):
    """enable() passes it to PyTorch's SDPA (which differentiates the mask);
    flash_attn and the op's autograd refuse it rather than drop its gradient."""
    q, k, v = qkv(1, 2, 2, 40, 40, 16, torch.float32, requires_grad=True)
    mask = torch.randn(40, 40, requires_grad=True)
    assert tfb.explain(q, k, v, attn_mask=mask).reason == "attn_mask requires grad"
    with tfb.enable():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    assert mask.grad is not None and tfb.stats()["fallback"] == {"attn_mask requires grad": 1}
    with tfb.enable(strict=True), pytest.raises(tfb.UnsupportedError, match="attn_mask requires grad"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
        tfb.flash_attn(q, k, v, attn_mask=mask)
    out, _ = ops.fwd(q, k, v, attn_mask=mask)
    with pytest.raises(RuntimeError, match="attn_mask requires grad"):
        out.sum().backward()
    with torch.no_grad():  # no gradient asked: served
        assert torch.isfinite(tfb.flash_attn(q, k, v, attn_mask=mask)).all()


def test_mask_dtypes(cpu_routing):
    """q's dtype or float32, as SDPA takes them; another float dtype falls back
    (PyTorch's SDPA then rejects it)."""
    q, k, v = qkv(1, 2, 2, 40, 40, 16, torch.bfloat16)
    for dtype, served in ((torch.bfloat16, True), (torch.float32, True), (torch.float16, False)):
        decision = tfb.explain(q, k, v, attn_mask=torch.zeros(40, 40, dtype=dtype))
        assert decision.served == served, (dtype, decision)
    assert "q's dtype (torch.bfloat16) or float32" in decision.reason


# ------------------------------------------------------------------ CUDA

cuda = pytest.mark.gpu
DTYPES = (torch.float16, torch.bfloat16)
GPU_SHAPES = [(2, 4, 4, 128, 128), (1, 8, 2, 300, 517), (2, 4, 1, 1000, 17), (1, 2, 2, 17, 1000)]
GPU_KINDS = ["bias", "kinds", "min", "alibi"]


def require(family, pass_, dtype, e):
    dn = "fp16" if dtype == torch.float16 else "bf16"
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 runs on compute capability 9.0 alone")
    if f"{family}_{pass_}_{dn}_hdim{e}" not in tfb.built_kernels():
        pytest.skip(f"{family}_{pass_}_{dn}_hdim{e} not built")


@pytest.fixture
def all_families():
    with testing.kernel_families():
        yield


@cuda
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda c: "b{}_h{}-{}_L{}_S{}".format(*c))
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("mask_dtype", ["q", "fp32"])
def test_cuda_tiled(mask_dtype, kind, shape, family, all_families):
    """sm80 / sm90 forward and the sm80 backward (which serves additive masks on Hopper too)."""
    require(family, "fwd", torch.bfloat16, 128)
    b, hq, hkv, length, s = shape
    q, k, v = qkv(b, hq, hkv, length, s, 128, torch.bfloat16, "cuda", seed=stable_seed(kind, shape))
    mask = make_mask(kind, b, hq, length, s, torch.bfloat16 if mask_dtype == "q" else torch.float32, "cuda")
    torch.empty(q.numel() * 3 + 4096, device="cuda", dtype=q.dtype).fill_(float("nan"))  # poison freed memory
    check_ops(q, k, v, mask, f"{family} {shape} {kind} mask {mask_dtype}", family, backward=family == "sm80")


@cuda
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("e", [32, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_every_head_dim(dtype, e, family, all_families):
    require(family, "fwd", dtype, e)
    q, k, v = qkv(2, 4, 2, 200, 333, e, dtype, "cuda", seed=e)
    check_ops(q, k, v, make_mask("kinds", 2, 4, 200, 333, dtype, "cuda"), f"{family} E{e} {dtype}", family,
              backward=family == "sm80")
    check_ops(q, k, v, make_mask("bias", 1, 1, 200, 333, torch.float32, "cuda"), f"{family} E{e} {dtype} 2d",
              family, backward=family == "sm80")


@cuda
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_cuda_negative_scale(family, all_families):
    require(family, "fwd", torch.bfloat16, 64)
    q, k, v = qkv(1, 4, 2, 190, 260, 64, torch.bfloat16, "cuda")
    check_ops(q, k, v, make_mask("kinds", 1, 4, 190, 260, torch.float32, "cuda"), f"{family} scale -0.2", family,
              backward=family == "sm80", scale=-0.2)


@cuda
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("length,s", [(1, 1000), (1, 4099), (4, 777)])
def test_cuda_decode(length, s, kind, all_families):
    """The decode family (one token or a few against a cache): values per score in the tiles that have any."""
    require("decode", "fwd", torch.bfloat16, 128)
    q, k, v = qkv(3, 8, 2, length, s, 128, torch.bfloat16, "cuda", seed=s)
    mask = make_mask(kind, 3, 8, length, s, torch.float32, "cuda")
    check_ops(q, k, v, mask, f"decode L{length} S{s} {kind}", "decode", backward=False)


@cuda
@pytest.mark.parametrize("family", ["sm80", "sm90", "decode"])
def test_cuda_hidden_tiles_are_skipped(family, all_families):
    """Keys whose values are -inf in whole 256-key blocks hold NaN: a kernel
    that loaded them would put NaN into every row; the tiles are skipped."""
    length = 1 if family == "decode" else 256
    require(family, "fwd", torch.bfloat16, 128)
    q, k, v = qkv(1, 2, 2, length, 1024, 128, torch.bfloat16, "cuda")
    k, v = k.clone(), v.clone()
    mask = torch.randn(1, 1, length, 1024, device="cuda")
    mask[..., 256:512] = NEG_INF
    mask[..., 768:] = NEG_INF
    k[:, :, 256:512] = float("nan")
    v[:, :, 768:] = float("nan")
    out, lse = ops.fwd(q, k, v, None, False, family, attn_mask=mask)
    ref, _ = attention_ref(q, k.nan_to_num(0), v.nan_to_num(0), attn_mask=mask)
    assert torch.isfinite(out).all() and max_err(out, ref) < 2e-2
    if family == "sm80":
        dq, dk, dv = ops.bwd(torch.randn_like(q), q, k, v, out, lse, None, False, "sm80", attn_mask=mask)
        assert torch.isfinite(dq).all() and (dk[:, :, 256:512] == 0).all() and (dv[:, :, 768:] == 0).all()


@cuda
def test_cuda_sm90_backward_refuses_additive_masks(all_families):
    """sm90's backward reads boolean masks alone: pinned to it, an additive
    mask raises naming the families that read one; the router names sm80's."""
    require("sm90", "bwd", torch.bfloat16, 128)
    require("sm80", "bwd", torch.bfloat16, 128)
    q, k, v = qkv(1, 2, 2, 200, 300, 128, torch.bfloat16, "cuda")
    mask = torch.randn(1, 1, 200, 300, device="cuda", dtype=torch.bfloat16)
    out, lse = ops.fwd(q, k, v, None, False, "sm90", attn_mask=mask)
    dout = torch.randn_like(out)
    with pytest.raises(RuntimeError, match="family='sm90' has no backward kernel that reads an additive attn_mask.*sm80"):
        ops.bwd(dout, q, k, v, out, lse, None, False, "sm90", attn_mask=mask)
    chosen = _router.pinned_families(q, k, v, mask, needs_grad=True)[1]
    assert chosen == "sm80"
    ours = ops.bwd(dout, q, k, v, out, lse, None, False, chosen, attn_mask=mask)
    ref = ops.bwd(dout, q, k, v, out, lse, None, False, "sm80", attn_mask=mask)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


@cuda
def test_cuda_enable_and_explain():
    """enable(strict=True) serves a training step with an additive mask; explain
    names it and the share of tiles it hides (-inf everywhere in them)."""
    tfb.reset_stats()
    q, k, v = qkv(2, 8, 2, 1024, 1024, 128, torch.bfloat16, "cuda", requires_grad=True)
    mask = torch.zeros(2, 1, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    mask[..., 512:] = NEG_INF  # half the keys hidden: half the tiles skipped
    mask[..., :512] = torch.randn(2, 1, 1024, 512, device="cuda") * 0.5
    with tfb.enable(strict=True):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.sum().backward()
    assert sum(tfb.stats()["routed"].values()) == 1, tfb.stats()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*leaves, attn_mask=mask)
    ref.sum().backward()
    assert max_err(out, ref) < 2e-2
    for t, leaf in zip((q, k, v), leaves):
        assert max_err(t.grad, leaf.grad) < 5e-2 * max(1.0, leaf.grad.abs().max().item())
    decision = tfb.explain(q, k, v, attn_mask=mask, enable_gqa=True)
    assert decision.served and "additive attn_mask (bf16)" in decision.reason
    assert decision.tiles_skipped == pytest.approx(0.5, abs=0.02), decision
