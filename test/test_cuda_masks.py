"""Boolean attn_mask in the tiled families (sm80, sm90), forward and backward,
against the float64 reference.

Masks as callers build them: random per head, padding (each batch row's valid
length, broadcast over heads and rows), sliding windows of several widths,
block-sparse (whole tiles hidden), rows and tiles that see nothing, a key
dimension that is not contiguous, a 2-D mask broadcast over batch and heads;
odd L and S, GQA. Outputs and gradients must stay within 2x the error of
PyTorch's own SDPA in the same dtype (plus a floor); rows that see no key give
0 and no gradient, as PyTorch's math and efficient backends. Outputs land in
memory filled with NaN just before, so an element the kernels skip writing
fails the check.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_flash_backend as tfb
from torch_flash_backend import testing

from reference import assert_within_baseline, attention_ref, max_err, stable_seed

pytestmark = pytest.mark.gpu

ops = torch.ops.torch_flash_backend
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)


@pytest.fixture(autouse=True)
def all_families():
    with testing.kernel_families():
        yield


def require(dtype, e, family="sm80", passes=("fwd", "bwd")):
    dn = "fp16" if dtype == torch.float16 else "bf16"
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 runs on compute capability 9.0 alone")
    for p in passes:
        if f"{family}_{p}_{dn}_hdim{e}" not in tfb.built_kernels():
            pytest.skip(f"{family}_{p}_{dn}_hdim{e} not built")


def forward_family(e, dtype=torch.bfloat16, pass_="fwd"):
    """The family that serves a masked pass here: sm90 on Hopper where built, else sm80."""
    dn = "fp16" if dtype == torch.float16 else "bf16"
    hopper = torch.cuda.get_device_capability() == (9, 0)
    return "sm90" if hopper and f"sm90_{pass_}_{dn}_hdim{e}" in tfb.built_kernels() else "sm80"


FAMILIES = ["sm80", "sm90"]


def make(b, h, n, e, dtype, layout="blhe"):
    if layout == "blhe":  # (B, L, H, E).transpose(1, 2), a model's projection
        return torch.randn(b, n, h, e, device="cuda", dtype=dtype).transpose(1, 2)
    return torch.randn(b, h, n, e, device="cuda", dtype=dtype)


def make_mask(kind, b, hq, length, s):
    """Boolean masks (True = take part), on the GPU."""
    g = torch.Generator().manual_seed(b * 7919 + hq * 31 + length * 17 + s)
    rows, keys = torch.arange(length)[:, None], torch.arange(s)[None, :]
    if kind == "random":  # per head, about half visible; no tile empty
        return (torch.rand(b, hq, length, s, generator=g) > 0.5).cuda()
    if kind == "padding":  # (B, 1, 1, S): batch row i uses its first valid[i] keys, the last all
        valid = torch.randint(1, s + 1, (b,), generator=g)
        valid[-1] = s
        return (keys[None] < valid[:, None, None])[:, None].cuda()
    if kind.startswith("window"):  # causal band of the given width, bottom-right aligned, (1, 1, L, S)
        width = int(kind[len("window"):])
        diag = rows + (s - length)
        return ((keys <= diag) & (keys > diag - width))[None, None].cuda()
    if kind == "blocks":  # block-sparse, 64 x 64 blocks per head; some blocks in part
        blocks = torch.rand(b, hq, (length + 63) // 64, (s + 63) // 64, generator=g) > 0.6
        mask = blocks.repeat_interleave(64, 2).repeat_interleave(64, 3)[:, :, :length, :s].clone()
        mask[..., 5::37, :] = ~mask[..., 5::37, :]
        return mask.cuda()
    if kind == "empty":  # random with rows, whole query tiles and whole key ranges that see nothing
        mask = torch.rand(b, hq, length, s, generator=g) > 0.5
        mask[:, ::3, length // 2] = False
        mask[:, :, : min(length, 130)] &= keys >= min(s, 200)  # the first query tiles see only keys >= 200
        mask[-1, -1] = False
        return mask.cuda()
    if kind == "transposed":  # keys not contiguous: (B, H, S, L) seen as (B, H, L, S)
        return (torch.rand(b, hq, s, length, generator=g) > 0.5).cuda().transpose(-1, -2)
    if kind == "2d":  # (L, S), broadcast over batch and heads
        return (torch.rand(length, s, generator=g) > 0.3).cuda()
    raise ValueError(kind)


def poison(like, copies=3):
    torch.empty(like.numel() * copies + 4096, device="cuda", dtype=like.dtype).fill_(float("nan"))


def pytorch_sdpa(q, k, v, mask, backend=SDPBackend.MATH, grads_of=None, dout=None):
    """PyTorch's SDPA in the input dtype on one backend (math by default; its
    cuDNN backend gives rows that see nothing the unmasked attention, so it is
    no baseline here), NaN (rows that see nothing, in some versions) as 0."""
    group = q.size(1) // k.size(1)
    if backend == SDPBackend.EFFICIENT_ATTENTION and group > 1:  # it takes no enable_gqa
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.size(1) != k.size(1))
    if grads_of is None:
        return out.nan_to_num(0.0)
    return [g.nan_to_num(0.0) for g in torch.autograd.grad(out, grads_of, dout)]


def math_sdpa(q, k, v, mask):
    return pytorch_sdpa(q, k, v, mask)


def baseline_grads(q, k, v, mask, dout):
    """(dq, dk, dv) baselines: per gradient the worse of PyTorch's math and
    efficient backends (the efficient one rounds dS as FlashAttention-2 and
    our kernels do; the math one keeps more precision), as test_cuda_bwd.py
    takes the worse of the default and flash backends."""
    # The efficient backend wants the mask's rows 16-byte aligned: it gets the
    # same mask as an additive one in storage padded to 16 keys.
    s = mask.size(-1)
    bias = torch.zeros(*mask.shape[:-1], (s + 15) // 16 * 16, device="cuda", dtype=q.dtype)[..., :s]
    bias.masked_fill_(~mask, float("-inf"))
    runs = []
    for backend, m in ((SDPBackend.MATH, mask), (SDPBackend.EFFICIENT_ATTENTION, bias)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        runs.append(pytorch_sdpa(*leaves, m, backend, grads_of=leaves, dout=dout))
    return runs


KINDS = ["random", "padding", "window1", "window64", "window300", "blocks", "empty", "transposed", "2d"]
# (B, Hq, Hkv, L, S): odd and unequal lengths, GQA 4:1.
# S = 1008: whole 16-key pieces (the pre-pass's 16-byte loads), a last key tile in part.
SHAPES = [(2, 4, 4, 128, 128), (1, 8, 2, 300, 517), (2, 4, 1, 1000, 17), (1, 2, 2, 17, 1000), (1, 2, 2, 1, 129),
          (1, 4, 2, 200, 1008)]


def shape_id(c):
    return "b{}_h{}-{}_L{}_S{}".format(*c)


def check_forward(b, hq, hkv, length, s, e, dtype, kind, family="sm80"):
    q = make(b, hq, length, e, dtype)
    k, v = make(b, hkv, s, e, dtype), make(b, hkv, s, e, dtype)
    mask = make_mask(kind, b, hq, length, s)
    poison(q)
    out, lse = ops.fwd(q, k, v, None, False, family, attn_mask=mask)
    torch.cuda.synchronize()
    name = f"{family} b{b} h{hq}:{hkv} L{length} S{s} E{e} {dtype} mask={kind}"
    ref_out, ref_lse = attention_ref(q, k, v, attn_mask=mask)
    assert_within_baseline(name, out, math_sdpa(q, k, v, mask), ref_out)
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all() and torch.isinf(lse[empty]).all(), f"{name}: rows that see no key"
    seen = ~empty
    assert max_err(lse[seen], ref_lse[seen]) <= 1e-3, f"{name}: lse"
    return q, k, v, mask


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("kind", KINDS)
def test_forward(kind, shape, family):
    require(torch.bfloat16, 128, family, passes=("fwd",))
    torch.manual_seed(stable_seed(kind, shape))
    check_forward(*shape, 128, torch.bfloat16, kind, family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("e", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_every_head_dim(dtype, e, family):
    require(dtype, e, family, passes=("fwd",))
    torch.manual_seed(e)
    check_forward(2, 4, 2, 200, 333, e, dtype, "blocks", family)
    check_forward(1, 2, 2, 129, 250, e, dtype, "window64", family)
    check_forward(2, 2, 2, 300, 700, e, dtype, "empty", family)
    check_forward(1, 2, 1, 200, 1008, e, dtype, "blocks", family)  # 16-byte loads, a last key tile in part


@pytest.mark.parametrize("kind", ["window300", "blocks", "empty", "padding"])
def test_forward_more_units_than_sms(kind):
    """Once each CTA has its first unit, the sm90 forward hands out a masked
    call's units from a counter (tile_scheduler.h): here several units per SM,
    of unequal cost. A second call must find the counter zero again: it gives
    the same bits (each unit's arithmetic is fixed, whichever CTA runs it)."""
    require(torch.bfloat16, 128, "sm90", passes=("fwd",))
    torch.manual_seed(stable_seed(kind, 2))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    length = 1536  # 12 query tiles of 128 rows
    heads = 2 * -(-3 * sms // (2 * 2 * 12))  # B 2, an even count (GQA 2:1): at least 3 units per SM
    q, k, v, mask = check_forward(2, heads, heads // 2, length, length, 128, torch.bfloat16, kind, "sm90")
    first, _ = ops.fwd(q, k, v, None, False, "sm90", attn_mask=mask)
    poison(q)
    again, _ = ops.fwd(q, k, v, None, False, "sm90", attn_mask=mask)
    assert torch.equal(first, again), f"sm90 mask={kind}: a second call differs"


def check_backward(b, hq, hkv, length, s, e, dtype, kind, family="sm80"):
    """The backward op on the reference's out and lse, against float64 autograd."""
    q, k, v, dout = (make(b, h, n, e, dtype) for h, n in ((hq, length), (hkv, s), (hkv, s), (hq, length)))
    mask = make_mask(kind, b, hq, length, s)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_ref(q64, k64, v64, attn_mask=mask)
    ref = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    out = out64.detach().to(dtype)
    lse = lse64.detach().float().contiguous()
    poison(q, copies=6)
    ours = ops.bwd(dout, q, k, v, out, lse, None, False, family, attn_mask=mask)
    torch.cuda.synchronize()
    runs = baseline_grads(q, k, v, mask, dout)
    name = f"{family} b{b} h{hq}:{hkv} L{length} S{s} E{e} {dtype} mask={kind}"
    for i, (what, o, r) in enumerate(zip(("dq", "dk", "dv"), ours, ref)):
        worst = max((run[i] for run in runs), key=lambda g: max_err(g, r))
        assert_within_baseline(f"{name} {what}", o, worst, r, floor=1e-4)
    empty = torch.isneginf(lse64.detach())
    assert (ours[0][empty] == 0).all(), f"{name}: dq of rows that see no key"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("kind", KINDS)
def test_backward(kind, shape, family):
    require(torch.bfloat16, 128, family, passes=("bwd",))
    torch.manual_seed(stable_seed(kind, shape, 1))
    check_backward(*shape, 128, torch.bfloat16, kind, family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("e", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_every_head_dim(dtype, e, family):
    require(dtype, e, family, passes=("bwd",))
    torch.manual_seed(e + 1)
    check_backward(2, 4, 2, 200, 333, e, dtype, "blocks", family)
    check_backward(1, 2, 2, 129, 250, e, dtype, "empty", family)
    check_backward(2, 4, 1, 300, 700, e, dtype, "padding", family)
    check_backward(1, 2, 1, 200, 1008, e, dtype, "window300", family)  # 16-byte loads, a last key tile in part


@pytest.mark.parametrize("family", FAMILIES)
def test_backward_deterministic(family):
    """torch.use_deterministic_algorithms: the same bits on every run, masked too."""
    require(torch.bfloat16, 128, family, passes=("bwd",))
    q, k, v, dout = (make(2, 4, 500, 128, torch.bfloat16) for _ in range(4))
    mask = make_mask("blocks", 2, 4, 500, 500)
    out, lse = ops.fwd(q, k, v, None, False, "sm80", attn_mask=mask)
    with testing.deterministic_algorithms():
        runs = [ops.bwd(dout, q, k, v, out, lse, None, False, family, attn_mask=mask) for _ in range(3)]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))
    ref = ops.bwd(dout, q, k, v, out, lse, None, False, family, attn_mask=mask)
    for a, b in zip(runs[0], ref):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_tiles_are_skipped(family):
    """Keys the mask hides in whole 256-key blocks hold NaN; a kernel that
    loaded and multiplied them would put NaN into every row (0 * NaN). The
    tiled kernels skip such tiles, so the output (and sm80's gradients) are
    finite and right; so are both backwards' gradients."""
    require(torch.bfloat16, 128, family)
    b, h, length, s, e = 1, 2, 256, 1024, 128
    q, dout = make(b, h, length, e, torch.bfloat16), make(b, h, length, e, torch.bfloat16)
    k, v = (make(b, h, s, e, torch.bfloat16) for _ in range(2))
    mask = torch.ones(b, 1, length, s, dtype=torch.bool, device="cuda")
    mask[..., 256:512] = False
    mask[..., 768:] = False
    mask[..., 100, 0] = False  # one mixed tile among them
    k[:, :, 256:512] = float("nan")
    v[:, :, 768:] = float("nan")
    out, lse = ops.fwd(q, k, v, None, False, family, attn_mask=mask)
    ref, _ = attention_ref(q.nan_to_num(0), k.nan_to_num(0), v.nan_to_num(0), attn_mask=mask)
    assert torch.isfinite(out).all() and max_err(out, ref) < 2e-2
    dq, dk, dv = ops.bwd(dout, q, k, v, out, lse, None, False, family, attn_mask=mask)
    assert torch.isfinite(dq).all() and (dk[:, :, 256:512] == 0).all() and (dv[:, :, 768:] == 0).all()


def test_enable_serves_masked_training():
    """Under enable(strict=True) a boolean mask with a long query and grad runs
    our kernels both ways (sm90's on Hopper), as a padded Hugging Face batch
    passes it; the grads match float64's."""
    require(torch.bfloat16, 128)
    fwd, bwd = forward_family(128), forward_family(128, pass_="bwd")
    b, hq, hkv, length, e = 2, 8, 2, 300, 128
    q = make(b, hq, length, e, torch.bfloat16).requires_grad_()
    k, v = (make(b, hkv, length, e, torch.bfloat16).requires_grad_() for _ in range(2))
    mask = make_mask("padding", b, hq, length, length) & torch.ones(length, length, device="cuda").tril().bool()
    decision = tfb.explain(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (decision.kernel, decision.backward_kernel) == (f"{fwd}_fwd_bf16_hdim128", f"{bwd}_bwd_bf16_hdim128"), \
        str(decision)

    def step():
        with tfb.enable(strict=True):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return out, torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    assert testing.launched_families(step) == {fwd, bwd}
    out, grads = step()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out64, _ = attention_ref(*leaves, attn_mask=mask)
    ref = torch.autograd.grad(out64, leaves, torch.ones_like(out64))
    assert_within_baseline("out", out.detach(), math_sdpa(q.detach(), k.detach(), v.detach(), mask), out64.detach())
    runs = baseline_grads(q, k, v, mask, torch.ones_like(out))
    for i, (what, g, r) in enumerate(zip(("dq", "dk", "dv"), grads, ref)):
        worst = max((run[i] for run in runs), key=lambda x: max_err(x, r))
        assert_within_baseline(what, g, worst, r, floor=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_opcheck_masked_cuda(family):
    require(torch.bfloat16, 64, family)
    q, k, v = (make(2, 4, 40, 64, torch.bfloat16) for _ in range(3))
    mask = make_mask("blocks", 2, 4, 40, 40)
    torch.library.opcheck(ops.fwd.default, (q, k, v, None, False, family), {"attn_mask": mask})
    out, lse = ops.fwd(q, k, v, None, False, family, attn_mask=mask)
    torch.library.opcheck(ops.bwd.default, (torch.randn_like(out), q, k, v, out, lse, None, False, family),
                          {"attn_mask": mask})


def test_explain_states_the_share_of_tiles_a_window_hides():
    """explain() of a sliding-window call reads the mask and states the share
    of the serving kernel's tiles (its record's tile_rows x tile_keys) it
    hides: a band of 256 keys over 2048 rows keeps a few key tiles per query
    tile (sm80: 128 x 64, 6 of 32; sm90: 128 x 128, 3 of 16)."""
    require(torch.bfloat16, 128, passes=("fwd",))
    q, k, v = (make(1, 2, 2048, 128, torch.bfloat16) for _ in range(3))
    mask = make_mask("window256", 1, 2, 2048, 2048)
    d = tfb.explain(q, k, v, attn_mask=mask)
    assert d.kernel == f"{forward_family(128)}_fwd_bf16_hdim128", str(d)
    from torch_flash_backend import _router
    record = next(x for x in _router.probe.kernels() if str(x) == d.kernel)
    tm, tn = record.tile_rows, record.tile_keys
    tiles = mask[0, 0].reshape(2048 // tm, tm, 2048 // tn, tn).any(dim=3).any(dim=1)
    assert d.tiles_skipped == pytest.approx(1 - tiles.float().mean().item())
    assert 0.8 < d.tiles_skipped < 0.9 and f"hides {d.tiles_skipped:.0%} of its tiles" in str(d), str(d)
