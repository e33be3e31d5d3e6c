"""Head dims without an instantiation of their own: a multiple of 8 runs on the
next larger kernel built, its extra columns zeros on chip (TMA's out-of-bounds
fill on sm90, predicated cp.async on sm80) and never written back.

CPU: the router's choice over the registry's records (FakeTensors). GPU: every
family's forward and backward against float64 at head dims between the built
ones, and the Python rule (_library.serving_kernel) against the ops' own
(csrc/cuda/families.cpp serving_head_dim)."""
import contextlib

import expecttest
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend

import torch_flash_backend as tfb
from torch_flash_backend import _library, _router, testing

from reference import assert_within_baseline, attention_ref, max_err, stable_seed
from test_cuda_bwd import _sdpa_grads, inputs_and_reference

SM80 = testing.registry_kernel_names("sm80")
SM90 = testing.registry_kernel_names("sm90")
DECODE = testing.registry_kernel_names("decode")
# Between and below the built head dims (sm80: 32, 64, 96, 128, 192, 256; sm90 adds 80), Phi-2's 80 among them.
ODD_HEAD_DIMS = (8, 40, 72, 80, 112, 136, 160, 200, 248)


@pytest.fixture(autouse=True)
def all_families():
    with testing.kernel_families():
        yield


def _qkv(e, length=64, requires_grad=False, dtype=torch.bfloat16):
    return [torch.empty(2, 4, length, e, dtype=dtype, device="cuda", requires_grad=requires_grad) for _ in range(3)]


def _next_built(e, dims):
    return min(d for d in dims if d >= e)


@pytest.mark.parametrize("capability,family,dims", [((9, 0), "sm90", (64, 80, 96, 128, 192, 256)),
                                                    ((8, 0), "sm80", (32, 64, 96, 128, 192, 256))])
def test_router_serves_a_multiple_of_8_with_the_next_larger_kernel(capability, family, dims):
    with FakeTensorMode(), testing.pretend_cuda(capability=capability, kernels=SM80 + SM90 + DECODE):
        for e in range(8, 257, 8):
            # A kernel of the head dim's own, in any family, comes first (sm80's 32 on Hopper).
            fam, want = ("sm80", 32) if e == 32 else (family, _next_built(e, dims))
            d = tfb.explain(*_qkv(e, requires_grad=True), is_causal=True)
            assert (d.kernel, d.backward_kernel) == (f"{fam}_fwd_bf16_hdim{want}",
                                                     f"{fam}_bwd_bf16_hdim{want}"), (e, str(d))
    # A build with only some head dims: a family's own kernel before another's padded one.
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=SM80 + ["sm90_fwd_bf16_hdim128"]):
        assert tfb.explain(*_qkv(64)).kernel == "sm80_fwd_bf16_hdim64"
        assert tfb.explain(*_qkv(112)).kernel == "sm90_fwd_bf16_hdim128"


def test_router_refuses_what_no_kernel_pads():
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=SM80 + SM90 + DECODE):
        for e in (36, 100, 264):  # not a multiple of 8; past the largest kernel
            d = tfb.explain(*_qkv(e))
            assert not d.served and d.reason == (f"no kernel has head dim {e} for bf16; head dims built: 32, 64, "
                                                 "80, 96, 128, 192, 256 (a smaller multiple of 8 runs on the next "
                                                 "larger)"), str(d)
        # The decode family serves its own head dims alone: a decode step at 80 goes to PyTorch.
        d = tfb.explain(*_qkv(80, length=1), strict=False)
        assert not d.served, str(d)
        assert tfb.explain(*_qkv(64, length=2)).kernel == "decode_fwd_bf16_hdim64"
        assert tfb.explain(*_qkv(80, length=2)).kernel is None


def test_serving_kernel_rule():
    records = testing.fake_kernels(SM90 + DECODE)
    pick = _library.serving_kernel
    assert pick(records, "sm90", "fwd", "bf16", 80, 80) == "sm90_fwd_bf16_hdim80"
    assert pick(records, "sm90", "bwd", "bf16", 88, 88) == "sm90_bwd_bf16_hdim96"
    assert pick(records, "sm90", "bwd", "fp16", 8, 8) == "sm90_bwd_fp16_hdim64"
    assert pick(records, "sm90", "fwd", "bf16", 192, 128) == "sm90_fwd_bf16_hdim192"  # MLA's shape
    assert pick(records, "sm90", "fwd", "bf16", 64, 72) == "sm90_fwd_bf16_hdim80"
    assert pick(records, "sm90", "fwd", "bf16", 12, 12) is None
    assert pick(records, "sm90", "fwd", "bf16", 264, 264) is None
    assert pick(records, "decode", "fwd", "bf16", 64, 64) == "decode_fwd_bf16_hdim64"
    assert pick(records, "decode", "fwd", "bf16", 40, 40) is None


# ---------------------------------------------------------------------------
# GPU

def _families_here():
    if not torch.cuda.is_available():
        return []
    return ["sm80"] + (["sm90"] if torch.cuda.get_device_capability() == (9, 0) else [])


# (batch, q heads, kv heads, L, S, causal, layout, scale): odd lengths, GQA,
# a row stride past the head dim ("padded"), custom scales.
CASES = [
    (2, 4, 4, 128, 128, False, "bhle", None),
    (1, 8, 2, 127, 129, True, "blhe", None),
    (2, 2, 2, 17, 300, False, "padded", 0.3),
    (1, 4, 1, 333, 333, True, "blhe", None),
]


def _case_id(c):
    return "b{}_h{}-{}_L{}_S{}_{}_{}_s{}".format(*c[:5], "causal" if c[5] else "full", *c[6:])


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("head_dim", ODD_HEAD_DIMS)
def test_forward_and_backward_at_head_dims_between_kernels(head_dim, case, family):
    if family not in _families_here():
        pytest.skip(f"{family} does not run here")
    _, hq, hkv, _, _, causal, _, scale = case
    # float16: bfloat16's 8-bit rounding of the outputs outweighs the kernels'
    # arithmetic in this criterion (an output one ulp off against a correctly
    # rounded baseline is 2x already); test_padding_adds_nothing shows bfloat16
    # gives bitwise what the larger kernel gives.
    dtype = torch.float16
    torch.manual_seed(stable_seed(head_dim, case, family))
    q, k, v, dout, out64, lse64, ref = inputs_and_reference(case, head_dim, dtype)

    out, lse = torch.ops.torch_flash_backend.fwd(q, k, v, scale, causal, family)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.stride(-1) == 1
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        base = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                                enable_gqa=hq != hkv)
    assert_within_baseline(f"{family} out", out, base, out64, floor=1e-4)
    assert (lse.double() - lse64).abs().max().item() < 1e-3

    grads = torch.ops.torch_flash_backend.bwd(dout, q, k, v, out, lse, scale, causal, family)
    torch.cuda.synchronize()
    # The baseline: the worst of PyTorch's backends that serve the call (its flash
    # kernel refuses causal L != S; its own backends differ by up to 3x here).
    baselines = [g for g in (_sdpa_grads(q, k, v, dout, causal, scale, backend)
                             for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                             SDPBackend.CUDNN_ATTENTION)) if g is not None]
    for i, (name, o, r) in enumerate(zip(("dq", "dk", "dv"), grads, ref)):
        worst = max((g[i] for g in baselines), key=lambda g: max_err(g, r))
        assert_within_baseline(f"{family} {name}", o, worst, r, floor=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("head_dim", ODD_HEAD_DIMS)
def test_padding_adds_nothing(head_dim, family):
    """A head dim run on a larger kernel gives bitwise what that kernel gives on
    the same tensors zero-padded to its head dim in memory (deterministic
    backward: dQ summed in a fixed order); the padded columns come out 0 there.
    So the padding costs no accuracy: the error is the larger kernel's own."""
    if family not in _families_here():
        pytest.skip(f"{family} does not run here")
    kernel_dim = int(_library.serving_kernel(tfb.built_kernels(), family, "fwd", "bf16", head_dim,
                                             head_dim).head_dim)
    ops = torch.ops.torch_flash_backend
    torch.manual_seed(stable_seed(head_dim, family))
    q = torch.randn(2, 300, 8, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(2, 257, 2, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    dout = torch.randn_like(q)
    scale = head_dim ** -0.5
    padded = [torch.nn.functional.pad(t, (0, kernel_dim - head_dim)) for t in (q, k, v, dout)]
    with testing.deterministic_algorithms():
        for causal in (False, True):
            out, lse = ops.fwd(q, k, v, scale, causal, family)
            grads = ops.bwd(dout, q, k, v, out, lse, scale, causal, family)
            out_p, lse_p = ops.fwd(*padded[:3], scale, causal, family)
            grads_p = ops.bwd(padded[3], *padded[:3], out_p, lse_p, scale, causal, family)
            assert torch.equal(out, out_p[..., :head_dim]) and torch.equal(lse, lse_p), (causal, "out")
            assert not out_p[..., head_dim:].any()
            for name, g, g_p in zip(("dq", "dk", "dv"), grads, grads_p):
                assert torch.equal(g, g_p[..., :head_dim]), (causal, name)
                assert not g_p[..., head_dim:].any(), (causal, name)


@pytest.mark.gpu
def test_neighbouring_heads_are_not_overwritten():
    """Heads side by side in one row (B, L, H, E): a kernel writing its padded
    columns would overwrite the next head's first ones."""
    for family in _families_here():
        torch.manual_seed(1)
        q, k, v, dout = (torch.randn(1, 200, 6, 40, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                         for _ in range(4))
        out, lse = torch.ops.torch_flash_backend.fwd(q, k, v, None, False, family)
        ref, _ = attention_ref(q, k, v)
        assert (out.double() - ref).abs().max().item() < 2e-2, family
        dq, dk, dv = torch.ops.torch_flash_backend.bwd(dout, q, k, v, out, lse, None, False, family)
        assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        grads = torch.autograd.grad(attention_ref(q64, k64, v64)[0], (q64, k64, v64), dout.double())
        for name, ours, want in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
            assert (ours.double() - want).abs().max().item() < 5e-2, (family, name)


@pytest.mark.gpu
def test_python_rule_matches_the_ops():
    """_library.serving_kernel (the router's) and serving_head_dim (the ops'):
    for each head dim, a family's op runs it exactly when the router's rule
    finds it a kernel."""
    records = tfb.built_kernels()
    for family in _families_here():
        for e in list(range(8, 265, 8)) + [12, 36, 100]:
            wide = torch.randn(1, 2, 16, e + (-e) % 8 + 8, device="cuda", dtype=torch.float16)
            q = k = v = dout = wide[..., :e]  # 16-byte aligned rows whatever e is
            want_fwd = _library.serving_kernel(records, family, "fwd", "fp16", e, e) is not None
            want_bwd = _library.serving_kernel(records, family, "bwd", "fp16", e, e) is not None
            try:
                out, lse = torch.ops.torch_flash_backend.fwd(q, k, v, None, False, family)
                ran = True
            except RuntimeError as err:
                assert "has no forward kernel for fp16 head dims q/k" in str(err), str(err)
                ran = False
            assert ran == want_fwd, (family, e)
            if ran:
                try:
                    torch.ops.torch_flash_backend.bwd(dout, q, k, v, out, lse, None, False, family)
                    ran_bwd = True
                except RuntimeError as err:
                    assert "has no backward kernel for fp16 head dims q/k" in str(err), str(err)
                    ran_bwd = False
                assert ran_bwd == want_bwd, (family, e)


@pytest.mark.gpu
def test_enable_serves_a_head_dim_of_80_both_ways():
    """A model's call (Phi-2's head dim 80) under enable(): served by our kernels
    forward and backward, as the router names them (Hopper's own 80, else sm80's 96)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 300, h, 80, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for h in (8, 2, 2))
    decision = tfb.explain(q, k, v, is_causal=True, enable_gqa=True)
    kernel = "hdim80" if torch.cuda.get_device_capability() == (9, 0) else "hdim96"
    assert decision.served and decision.kernel.endswith(kernel) and decision.backward_kernel.endswith(kernel), \
        str(decision)
    dout = torch.randn(2, 8, 300, 80, device="cuda", dtype=torch.bfloat16)
    tfb.reset_stats()
    with tfb.enable(strict=True):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    routed = tfb.stats()["routed"]
    assert any(kernel in name for name in routed), routed
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, _ = attention_ref(q64, k64, v64, None, True)
    ref = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    with torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # PyTorch's own, same dtype
        base = _sdpa_grads(q, k, v, dout, True, None, SDPBackend.FLASH_ATTENTION)
        base_out = torch.nn.functional.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(),
                                                                    is_causal=True, enable_gqa=True)
    assert_within_baseline("out", out, base_out, out64, floor=1e-4)
    for name, ours, b, r in zip(("dq", "dk", "dv"), grads, base, ref):
        assert_within_baseline(name, ours, b, r, floor=1e-4)


# ---------------------------------------------------------------------------
# A value head dim unlike the query's (multi-head latent attention: q/k 192, v 128)

MLA_PAIRS = ((192, 128), (128, 64), (64, 128), (256, 128), (40, 24))


def _mla(b, hq, hkv, L, S, e, ev, dtype, device, layout="blhe"):
    def make(h, n, dim):
        if layout == "blhe":
            return torch.randn(b, n, h, dim, device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(b, h, n, dim, device=device, dtype=dtype)
    return make(hq, L, e), make(hkv, S, e), make(hkv, S, ev), make(hq, L, ev)


@pytest.mark.parametrize("e,ev", MLA_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_ops_take_a_value_head_dim_unlike_the_querys(e, ev, causal):
    torch.manual_seed(stable_seed(e, ev, causal))
    q, k, v, dout = _mla(2, 4, 2, 37, 53, e, ev, torch.float32, "cpu")
    ops = torch.ops.torch_flash_backend
    out, lse = ops.fwd(q, k, v, None, causal)
    assert out.shape == (2, 4, 37, ev) and lse.shape == (2, 4, 37)
    dq, dk, dv = ops.bwd(dout, q, k, v, out, lse, None, causal)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_ref(q64, k64, v64, None, causal)
    ref = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    assert (out.double() - out64).abs().max().item() < 1e-4
    assert (lse.double() - lse64).abs().max().item() < 1e-4
    for name, ours, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert (ours.double() - want).abs().max().item() < 1e-4, name


def test_opcheck_with_a_value_head_dim_unlike_the_querys():
    torch.manual_seed(0)
    q, k, v, dout = _mla(1, 4, 2, 17, 23, 64, 32, torch.float32, "cpu", layout="bhle")
    out, lse = torch.ops.torch_flash_backend.fwd(q, k, v, None, True)
    torch.library.opcheck(torch.ops.torch_flash_backend.fwd.default, (q, k, v, None, True))
    torch.library.opcheck(torch.ops.torch_flash_backend.bwd.default, (dout, q, k, v, out, lse, None, True))


def test_fake_kernels_give_the_value_head_dim():
    with FakeTensorMode():
        q, k, v, dout = _mla(2, 8, 2, 100, 120, 192, 128, torch.bfloat16, "cuda")
        out, lse = torch.ops.torch_flash_backend.fwd(q, k, v, None, True, "sm90")
        assert out.shape == (2, 8, 100, 128) and lse.shape == (2, 8, 100)
        dq, dk, dv = torch.ops.torch_flash_backend.bwd(dout, q, k, v, out, lse, None, True, "sm90")
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        packed = [torch.empty(300, h, d, dtype=torch.bfloat16, device="cuda") for h, d in ((8, 192), (2, 192), (2, 128))]
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.torch_flash_backend.varlen_fwd(*packed, cu, cu, 200, 200, None, True, "sm90")
        assert out.shape == (300, 8, 128) and lse.shape == (8, 300)


def test_compiled_function_with_a_value_head_dim_unlike_the_querys():
    """torch.compile(fullgraph=True) over the CPU ops: the fake kernel's out shape is v's."""
    torch.manual_seed(0)
    q, k, v, _ = _mla(1, 4, 4, 33, 33, 64, 32, torch.float32, "cpu")
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return tfb.flash_attn(q, k, v, is_causal=True).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_export_with_a_value_head_dim_unlike_the_querys():
    """torch.export of SDPA under enable(strict=True) (CPU ops): the exported op's
    output takes v's head dim, and the program matches PyTorch's SDPA."""
    class Latent(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch.manual_seed(0)
    q, k, v, _ = _mla(1, 4, 2, 24, 24, 64, 32, torch.float32, "cpu", layout="bhle")
    with testing.route_cpu():
        ep = torch.export.export(tfb.enable(strict=True)(Latent()), (q, k, v))
    ours = [n for n in ep.graph.nodes if "torch_flash_backend" in str(n.target)]
    expecttest.assert_expected_inline(
        str([(str(n.target), [tuple(t.shape) for t in n.meta["val"]]) for n in ours]),
        """[('torch_flash_backend.fwd.default', [(1, 4, 24, 32), (1, 4, 24)])]""")
    torch.testing.assert_close(ep.module()(q, k, v), Latent()(q, k, v), atol=1e-5, rtol=1e-5)


def test_router_serves_a_value_head_dim_unlike_the_querys():
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=SM80 + SM90 + DECODE):
        for (e, ev), want in zip(MLA_PAIRS, (192, 128, 128, 256, 64)):
            q, k, v, _ = _mla(2, 8, 2, 300, 300, e, ev, torch.bfloat16, "cuda")
            q.requires_grad_()
            d = tfb.explain(q, k, v, is_causal=True, enable_gqa=True)
            assert (d.kernel, d.backward_kernel) == (f"sm90_fwd_bf16_hdim{want}", f"sm90_bwd_bf16_hdim{want}"), str(d)
            assert f"head dims {e} (q, k) and {ev} (v)" in d.reason
        q, k, v, _ = _mla(2, 8, 2, 300, 300, 128, 36, torch.bfloat16, "cuda")
        assert not tfb.explain(q, k, v, enable_gqa=True).served  # 36 is not a multiple of 8


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("e,ev", MLA_PAIRS)
def test_cuda_value_head_dim_unlike_the_querys(e, ev, causal, family):
    if family not in _families_here():
        pytest.skip(f"{family} does not run here")
    torch.manual_seed(stable_seed(e, ev, causal, family))
    q, k, v, dout = _mla(2, 8, 2, 257, 300, e, ev, torch.float16, "cuda")
    ops = torch.ops.torch_flash_backend
    out, lse = ops.fwd(q, k, v, None, causal, family)
    grads = ops.bwd(dout, q, k, v, out, lse, None, causal, family)
    torch.cuda.synchronize()
    assert out.shape == (2, 8, 257, ev)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_ref(q64, k64, v64, None, causal)
    ref = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    assert (lse.double() - lse64).abs().max().item() < 1e-3
    # PyTorch's backends that serve the shape (its flash kernel does not), worst first.
    runs = [r for r in (_sdpa_run(q, k, v, dout, causal, backend) for backend in
                        (None, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)) if r is not None]
    for i, (name, o, r) in enumerate(zip(("out", "dq", "dk", "dv"), (out, *grads), (out64, *ref))):
        worst = max((run[i] for run in runs), key=lambda x: max_err(x, r))
        assert_within_baseline(f"{family} {name}", o, worst, r, floor=1e-4)


def _sdpa_run(q, k, v, dout, causal, backend):
    """(out, dq, dk, dv) of PyTorch's SDPA with `backend` (None: its own choice); None if it refuses."""
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    try:
        with torch.nn.attention.sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal,
                                                                 enable_gqa=q.size(1) != k.size(1))
        return (o.detach(), *torch.autograd.grad(o, (qb, kb, vb), dout))
    except RuntimeError:
        return None


@pytest.mark.gpu
def test_enable_serves_latent_attention_both_ways():
    """DeepSeek-style latent attention's shape under enable(): q/k 192, v 128, GQA, causal."""
    torch.manual_seed(0)
    q, k, v, dout = _mla(2, 16, 4, 400, 400, 192, 128, torch.bfloat16, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    tfb.reset_stats()
    with tfb.enable(strict=True):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.shape == (2, 16, 400, 128)
    assert any("hdim192" in name for name in tfb.stats()["routed"]), tfb.stats()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, _ = attention_ref(q64, k64, v64, None, True)
    ref = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    base = _sdpa_run(q, k, v, dout, True, None)  # PyTorch's own choice, same dtype
    for name, ours, b, r in zip(("out", "dq", "dk", "dv"), (out, *grads), base, (out64, *ref)):
        assert_within_baseline(name, ours, b, r, floor=1e-4)
