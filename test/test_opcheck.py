"""torch.library.opcheck of the ops on CPU over a small grid (dtypes, GQA, causal,
L != S, strided layouts), with and without grad; the fake kernels' strides; the
functional entry against the float64 reference."""
import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_flash_backend as tfb
from reference import attention_ref

ops = torch.ops.torch_flash_backend


def make(b, h, n, e, dtype, layout, requires_grad=False, offset=0):
    """(b, h, n, e) in the given memory layout: "bhle" (contiguous), "blhe" (the
    transposed projection output), "offset" (a view into a larger buffer)."""
    if layout == "bhle":
        t = torch.randn(b, h, n, e, dtype=dtype)
    elif layout == "blhe":
        t = torch.randn(b, n, h, e, dtype=dtype).transpose(1, 2)
    else:
        t = torch.randn(b, h, n + 3, e + 8, dtype=dtype)[:, :, 3:, 8:]
    return t.requires_grad_(requires_grad)


# (dtype, Hq, Hkv, L, S, E, is_causal, scale, layout)
SAMPLES = [
    (torch.float32, 4, 4, 33, 33, 16, False, None, "bhle"),
    (torch.float32, 4, 2, 17, 40, 32, True, None, "blhe"),
    (torch.float32, 6, 1, 40, 17, 16, True, 0.3, "offset"),
    (torch.bfloat16, 4, 4, 24, 24, 64, True, None, "blhe"),
    (torch.bfloat16, 8, 2, 5, 70, 32, False, 0.5, "bhle"),
]


def sample_inputs(requires_grad):
    for dtype, hq, hkv, length, s, e, causal, scale, layout in SAMPLES:
        q = make(2, hq, length, e, dtype, layout, requires_grad)
        k = make(2, hkv, s, e, dtype, layout, requires_grad)
        v = make(2, hkv, s, e, dtype, layout, requires_grad)
        yield (q, k, v, scale, causal)


def sample_id(sample):
    dtype, hq, hkv, length, s, e, causal, scale, layout = sample
    return f"{str(dtype)[6:]}-h{hq}x{hkv}-L{length}-S{s}-E{e}-{'causal' if causal else 'full'}-{layout}"


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("index", range(len(SAMPLES)), ids=[sample_id(s) for s in SAMPLES])
def test_opcheck_fwd(index, requires_grad):
    args = list(sample_inputs(requires_grad))[index]
    torch.library.opcheck(ops.fwd.default, args)


@pytest.mark.parametrize("index", range(len(SAMPLES)), ids=[sample_id(s) for s in SAMPLES])
def test_opcheck_bwd(index):
    q, k, v, scale, causal = list(sample_inputs(False))[index]
    out, lse = ops.fwd(q, k, v, scale, causal)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(ops.bwd.default, (grad_out, q, k, v, out, lse, scale, causal))


@pytest.mark.parametrize("index", range(len(SAMPLES)), ids=[sample_id(s) for s in SAMPLES])
def test_opcheck_with_families(index):
    """The ops given the router's families (the CPU's), the backward's through autograd."""
    q, k, v, scale, causal = list(sample_inputs(True))[index]
    torch.library.opcheck(ops.fwd.default, (q, k, v, scale, causal, "cpu", "cpu"))
    out, lse = ops.fwd(q, k, v, scale, causal, "cpu", "cpu")
    torch.library.opcheck(ops.bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(),
                                            out.detach(), lse, scale, causal, "cpu"))


def test_fake_strides_match_real():
    for q, k, v, scale, causal in sample_inputs(False):
        real = ops.fwd(q, k, v, scale, causal)
        grads = ops.bwd(torch.randn_like(real[0]), q, k, v, *real, scale, causal)
        with FakeTensorMode() as mode:
            fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
            fake = ops.fwd(fq, fk, fv, scale, causal)
            fake_grads = ops.bwd(torch.empty_like(fake[0]), fq, fk, fv, *fake, scale, causal)
        for r, f in zip((*real, *grads), (*fake, *fake_grads)):
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
        b, h, length, e = q.shape
        assert real[0].stride() == torch.empty(b, length, h, e).transpose(1, 2).stride()
        assert real[1].is_contiguous() and real[1].dtype == torch.float32


@pytest.mark.parametrize("causal,hkv", itertools.product([False, True], [4, 2]))
def test_flash_attn_matches_reference(causal, hkv):
    q = make(2, 4, 40, 32, torch.float32, "blhe", requires_grad=True)
    k = make(2, hkv, 50, 32, torch.float32, "bhle", requires_grad=True)
    v = make(2, hkv, 50, 32, torch.float32, "offset", requires_grad=True)
    out = tfb.flash_attn(q, k, v, is_causal=causal, enable_gqa=hkv != 4)
    ref, _ = attention_ref(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.float(), atol=1e-4, rtol=1e-4)


def test_lse_is_not_differentiable():
    q = torch.randn(1, 2, 20, 16, requires_grad=True)
    out, lse = ops.fwd(q, q, q)
    assert out.requires_grad and not lse.requires_grad


def test_double_backward_is_refused():
    q = torch.randn(1, 2, 20, 16, requires_grad=True)
    (g,) = torch.autograd.grad(tfb.flash_attn(q, q, q).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


def test_gradient_with_odd_strides():
    """An expanded incoming gradient (as from .sum()) has stride 0 everywhere."""
    q = make(1, 2, 20, 16, torch.float32, "bhle", requires_grad=True)
    tfb.flash_attn(q, q, q).sum().backward()
    ref = q.detach().clone().requires_grad_()
    attention_ref(ref, ref, ref)[0].sum().backward()
    torch.testing.assert_close(q.grad, ref.grad.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strict,mask", [(False, False), (True, False), (False, True)])
def test_opcheck_route_sdpa(strict, mask):
    """route_sdpa, enable()'s decision as an op: served by the CPU ops (through
    the test switch), with an additive mask too."""
    from torch_flash_backend import testing

    q, k, v = (torch.randn(2, 4, 40, 16, requires_grad=True) for _ in range(3))
    attn_mask = torch.zeros(40, 40) if mask else None
    with testing.route_cpu():
        torch.library.opcheck(ops.route_sdpa.default, (q, k, v, attn_mask, 0.0, not mask, None, False, strict))


# (Hq, Hkv, L, S, mask shape, kind): masks broadcast as SDPA allows, with
# fully hidden rows (row 0 of every head sees nothing): boolean, or additive
# (random values, -inf where the boolean one hides).
MASKED = [
    (4, 2, 19, 40, (2, 4, 19, 40), "bool"),
    (4, 4, 5, 33, (2, 1, 1, 33), "bool"),
    (6, 3, 17, 17, (17, 17), "bool"),
    (4, 2, 19, 40, (2, 4, 19, 40), "additive"),
    (4, 4, 5, 33, (2, 1, 1, 33), "additive"),
    (6, 3, 17, 17, (17, 17), "additive"),
]
MASKED_IDS = [f"h{c[0]}x{c[1]}-L{c[2]}-S{c[3]}-mask{len(c[4])}d-{c[5]}" for c in MASKED]


def masked_inputs(hq, hkv, length, s, shape, kind, requires_grad):
    torch.manual_seed(length * 100 + s)
    q, k, v = (make(2, h, n, 16, torch.float32, "blhe", requires_grad) for h, n in ((hq, length), (hkv, s), (hkv, s)))
    mask = torch.rand(shape) > 0.4
    mask[..., 0, :] = False
    if kind == "additive":
        mask = (torch.randn(shape) * 2).masked_fill(~mask, float("-inf"))
    return q, k, v, mask


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("case", MASKED, ids=MASKED_IDS)
def test_opcheck_masked(case, requires_grad):
    q, k, v, mask = masked_inputs(*case, requires_grad)
    torch.library.opcheck(ops.fwd.default, (q, k, v, None, False), {"attn_mask": mask})
    out, lse = ops.fwd(q.detach(), k.detach(), v.detach(), attn_mask=mask)
    torch.library.opcheck(ops.bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse),
                          {"attn_mask": mask})


@pytest.mark.parametrize("case", MASKED, ids=MASKED_IDS)
def test_masked_matches_reference(case):
    """A mask on CPU, boolean or additive, forward and backward, against
    float64; rows the mask hides entirely give output 0, lse -inf and no gradient."""
    q, k, v, mask = masked_inputs(*case, True)
    out = tfb.flash_attn(q, k, v, attn_mask=mask, enable_gqa=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*leaves, attn_mask=mask)
    ref.backward(grad.double())
    for name, ours, want in (("out", out, ref), ("dq", q.grad, leaves[0].grad), ("dk", k.grad, leaves[1].grad),
                             ("dv", v.grad, leaves[2].grad)):
        err = (ours.double() - want).abs().max().item()
        assert err <= 2e-5 * max(1.0, want.abs().max().item()), f"{name}: error {err:.3e}"
    assert (out[:, :, 0] == 0).all() and (q.grad[:, :, 0] == 0).all()
    _, lse = ops.fwd(q.detach(), k.detach(), v.detach(), attn_mask=mask)
    assert torch.isneginf(lse[:, :, 0]).all()
    assert torch.allclose(lse[:, :, 1:].double(), ref_lse[:, :, 1:], atol=1e-5)


@pytest.mark.parametrize("mask,message", [
    (torch.ones(2, 4, 19, 40, dtype=torch.float16), "must be a bool tensor"),
    (torch.ones(2, 4, 19, 40, dtype=torch.int32), "must be a bool tensor"),
    (torch.ones(3, 4, 19, 40, dtype=torch.bool), "does not broadcast"),
    (torch.ones(1, 2, 4, 19, 40, dtype=torch.bool), "at most 4 dims"),
])
def test_bad_masks_are_named(mask, message):
    """The CPU kernel and the fake kernel refuse the same masks, naming attn_mask."""
    q, k, v, _ = masked_inputs(*MASKED[0], False)
    with pytest.raises(RuntimeError, match=message):
        ops.fwd(q, k, v, attn_mask=mask)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="attn_mask"):
        ops.fwd(*(mode.from_tensor(t) for t in (q, k, v)), attn_mask=mode.from_tensor(mask))
