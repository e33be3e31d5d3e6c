"""The packed variable-length ops (varlen_fwd / varlen_bwd): per-sequence
results against a float64 reference on CPU and (GPU tests) CUDA, their
argument checks, opcheck, fake kernels, and PyTorch's varlen_attn served
through the provider hook. Sequences are bottom-right aligned, as
FlashAttention's varlen."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_flash_backend as tfb
from torch_flash_backend import testing

from reference import assert_within_baseline

ops = torch.ops.torch_flash_backend

# Query and key lengths per sequence: L != S, empty sequences (no queries, no
# keys) and odd lengths among them.
LENS_Q = [5, 0, 17, 1, 33, 9]
LENS_K = [7, 3, 17, 0, 40, 9]


def packed(lens_q, lens_k, hq=4, hkv=2, e=16, dtype=torch.float32, spare_q=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q) + spare_q, hq, e, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hkv, e, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hkv, e, generator=g).to(dtype)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def reference(q, k, v, cu_q, cu_k, is_causal=False, window=(-1, -1), scale=None, used=None, compute=torch.float64):
    """Attention per sequence in `compute` (float64: the reference; the inputs'
    dtype: PyTorch's own same-dtype math, the error baseline), bottom-right
    aligned; rows that see no key give 0 and lse -inf."""
    hq, e = q.size(1), q.size(2)
    group = hq // k.size(1)
    scale = 1 / math.sqrt(e) if scale is None else scale
    out = torch.zeros(q.shape, dtype=compute, device=q.device)
    lse = torch.full((hq, q.size(0)), -math.inf, dtype=compute, device=q.device)
    for b in range(cu_q.numel() - 1):
        q0, length = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b])
        k0 = int(cu_k[b])
        s = int(used[b]) if used is not None else int(cu_k[b + 1] - cu_k[b])
        if length == 0 or s == 0:
            continue
        qb = q[q0:q0 + length].to(compute).transpose(0, 1)
        kb = k[k0:k0 + s].to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[k0:k0 + s].to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qb @ kb.transpose(1, 2) * scale
        i = torch.arange(length, device=q.device).view(-1, 1) + (s - length)
        j = torch.arange(s, device=q.device).view(1, -1)
        visible = torch.ones(length, s, dtype=torch.bool, device=q.device)
        if is_causal:
            visible &= j <= i
        if window[0] >= 0:
            visible &= j >= i - window[0]
        if window[1] >= 0:
            visible &= j <= i + window[1]
        scores = scores.masked_fill(~visible, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - row_lse.unsqueeze(-1)).nan_to_num(0.0)
        out[q0:q0 + length] = (p @ vb).transpose(0, 1)
        lse[:, q0:q0 + length] = row_lse
    return out, lse


CASES = [(False, (-1, -1)), (True, (-1, -1)), (True, (3, -1)), (False, (2, 1)), (False, (0, 0))]


@pytest.mark.parametrize("is_causal,window", CASES, ids=lambda c: str(c))
def test_forward_and_backward_match_reference(is_causal, window):
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, spare_q=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ops.varlen_fwd(*leaves, cu_q, cu_k, max(LENS_Q), max(LENS_K), None, is_causal, None, None, *window)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference(*ref_leaves, cu_q, cu_k, is_causal, window)
    assert out.shape == q.shape and lse.shape == (q.size(1), q.size(0))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-4)
    assert (out[-3:] == 0).all() and (lse[:, -3:] == -math.inf).all()  # rows no sequence covers
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    for name, ours, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(ours.double(), want, atol=5e-5, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_bfloat16_and_seqused_k():
    """seqused_k keeps each sequence's first keys (a cache in use); the keys past
    it get no gradient. bf16 inputs, float32 accumulation."""
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, dtype=torch.bfloat16, seed=1)
    used = torch.tensor([4, 0, 17, 0, 21, 9], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = ops.varlen_fwd(*leaves, cu_q, cu_k, max(LENS_Q), max(LENS_K), None, True, seqused_k=used)
    ref, _ = reference(q, k, v, cu_q, cu_k, True, used=used)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    _, dk, _ = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert (dk[4:7] == 0).all() and (dk[48:67] == 0).all()  # sequence 0: keys 4-6; sequence 4 (from key 27): 48-66


def test_matches_the_dense_op_on_equal_lengths():
    """Sequences of one length are a dense batch: the same numbers as fwd."""
    b, length, h, e = 3, 20, 4, 32
    q, k, v, cu_q, cu_k = packed([length] * b, [length] * b, hq=h, hkv=h, e=e)
    out, lse = ops.varlen_fwd(q, k, v, cu_q, cu_k, length, length, None, True)
    dense = [t.view(b, length, h, e).transpose(1, 2) for t in (q, k, v)]
    d_out, d_lse = ops.fwd(*dense, None, True)
    torch.testing.assert_close(out, d_out.transpose(1, 2).reshape(b * length, h, e))
    torch.testing.assert_close(lse, d_lse.permute(1, 0, 2).reshape(h, b * length))


def test_opcheck():
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    args = (*leaves, cu_q, cu_k, max(LENS_Q), max(LENS_K), 0.3, True, None, None, 4, -1)
    torch.library.opcheck(ops.varlen_fwd.default, args)
    out, lse = ops.varlen_fwd(*args)
    torch.library.opcheck(ops.varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, out.detach(), lse, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                           0.3, True, None, 4, -1))


def test_fake_kernels_give_the_real_shapes():
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K)
    real = ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40)
    with FakeTensorMode() as mode:
        fake = ops.varlen_fwd(*(mode.from_tensor(t) for t in (q, k, v, cu_q, cu_k)), 33, 40)
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def test_router_decides_packed_batches():
    """decide_varlen: the families whose records read per-sequence lengths
    serve a packed batch (sm80's, not sm90's), forward and backward; metadata
    PyTorch's kernel would reject goes to it with the ops' reason."""
    from torch_flash_backend import _router
    with FakeTensorMode(), testing.pretend_cuda():
        q = torch.empty(70, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(90, 2, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        d = _router.decide_varlen(q, k, k, cu, cu, 40, 50, 0.0, True, None, (-1, 0), needs_grad=True)
        assert d.served and (d.kernel, d.backward_kernel) == ("sm80_fwd_bf16_hdim64", "sm80_bwd_bf16_hdim64"), d
        assert "packed batch of 2 sequences" in d.reason and "bottom-right per sequence" in d.reason
        assert not _router.decide_varlen(q, k, k, cu.long(), cu, 40, 50).served
        assert "cu_seq_q must be an int32 tensor" in _router.decide_varlen(q, k, k, cu.long(), cu, 40, 50).reason
        assert "short query" in _router.decide_varlen(q, k, k, cu, cu, 8, 50).reason
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=["sm90_fwd_bf16_hdim64"]):
        q = torch.empty(70, 8, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        d = _router.decide_varlen(q, q, q, cu, cu, 40, 50)
        assert not d.served and "packed variable-length batch: no forward" in d.reason, d
    both = testing.registry_kernel_names("sm90", "sm80")
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=both):
        q = torch.empty(70, 8, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        # On Hopper sm90 comes first and reads no packed batch: enable() leaves it to PyTorch, strict takes sm80.
        d = _router.decide_varlen(q, q, q, cu, cu, 40, 50)
        assert not d.served and "the sm90 family, this chip's first, reads none" in d.reason, d
        assert _router.decide_varlen(q, q, q, cu, cu, 40, 50, pinned=True).kernel == "sm80_fwd_bf16_hdim64"
    kernels = ["sm80_fwd_bf16_hdim64", "sm90_bwd_bf16_hdim64"]
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=kernels):
        q = torch.empty(70, 8, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        d = _router.decide_varlen(q, q, q, cu, cu, 40, 50, needs_grad=True)
        assert not d.served and d.reason == _router.PACKED_GRAD_REASON, d


def test_explain_varlen_says_what_enable_would_do():
    """tfb.explain_varlen: varlen_attn's arguments, enable()'s decision, lenient and strict."""
    both = testing.registry_kernel_names("sm90", "sm80")
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=both):
        q = torch.empty(70, 8, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        lenient = tfb.explain_varlen(q, q, q, cu, cu, 40, 40, window_size=(-1, 0))
        assert not lenient.served and "reads none" in str(lenient)
        strict = tfb.explain_varlen(q, q, q, cu, cu, 40, 40, window_size=(-1, 0), strict=True)
        assert strict.served and strict.kernel == "sm80_fwd_bf16_hdim64" and "causal" in strict.reason
        windowed = tfb.explain_varlen(q, q, q, cu, cu, 40, 40, window_size=(16, 0), strict=True)
        assert "window (16, 0)" in windowed.reason and "causal" not in windowed.reason


def test_the_switch_sits_in_front_of_pytorchs_packed_kernels():
    """The package's switch (_provider.py) is the CUDA kernel of the two flash
    ops that packed batches reach, with the provider hook off too."""
    from torch.nn import attention as A
    from torch_flash_backend import _provider
    assert not _provider.active() and A.current_flash_attention_impl() != "torch_flash_backend"
    for op in ("_flash_attention_forward", "_flash_attention_backward"):
        lines = [line for line in torch._C._dispatch_dump(f"aten::{op}").splitlines() if line.startswith("CUDA")]
        assert "_provider.py" in lines[0], lines


def _bad(what):
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K)
    args = dict(q=q, k=k, v=v, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=33, max_k=40)
    if what == "int64 offsets":
        args["cu_seq_q"] = cu_q.long()
    elif what == "offsets of unequal length":
        args["cu_seq_k"] = cu_k[:-1]
    elif what == "4-D q":
        args["q"] = q.unsqueeze(0)
    elif what == "max_q below a sequence":
        args["max_q"] = 32
    elif what == "max_k past the keys":
        args["max_k"] = k.size(0) + 1
    elif what == "falling offsets":
        args["cu_seq_q"] = torch.tensor([0, 5, 3, 20, 21, 54, 65], dtype=torch.int32)
    elif what == "offsets past the tokens":
        args["cu_seq_k"] = cu_k + 1
    elif what == "seqused_k past a sequence":
        args["seqused_k"] = torch.tensor([8, 0, 0, 0, 0, 0], dtype=torch.int32)
    return args


@pytest.mark.parametrize("what,message", [
    ("int64 offsets", "cu_seq_q must be an int32 tensor"),
    ("offsets of unequal length", "cu_seq_k must have 7 elements"),
    ("4-D q", "q must be 3-D"),
    ("max_q below a sequence", r"max_q \(32\) is below sequence 4's 33 query tokens"),
    ("max_k past the keys", "max_k must lie in"),
    ("falling offsets", "cu_seq_q must rise"),
    ("offsets past the tokens", "cu_seq_k must rise"),
    ("seqused_k past a sequence", r"seqused_k\[0\] = 8 must lie in \[0, 7\]"),
])
def test_bad_arguments_are_named(what, message):
    args = _bad(what)
    with pytest.raises(RuntimeError, match=message):
        ops.varlen_fwd(**args)
    if what in ("int64 offsets", "offsets of unequal length", "4-D q", "max_k past the keys"):
        with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=message):  # the fake kernel checks too
            ops.varlen_fwd(**{n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for n, t in args.items()})


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


CUDA_LENS_Q = [0, 130, 1, 77, 300, 64, 5]
CUDA_LENS_K = [9, 200, 0, 77, 257, 64, 700]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_causal,window", CASES, ids=lambda c: str(c))
def test_cuda_sm80_forward_matches_float64(is_causal, window, head_dim):
    """sm80's forward on a packed batch (empty sequences, L != S, GQA, odd
    lengths): within twice PyTorch's own bf16 error against float64 per row,
    plus a floor, with poisoned outputs impossible (the op allocates them)."""
    _cuda()
    q, k, v, cu_q, cu_k = packed(CUDA_LENS_Q, CUDA_LENS_K, hq=8, hkv=2, e=head_dim, dtype=torch.bfloat16, spare_q=5)
    args = (cu_q.cuda(), cu_k.cuda(), max(CUDA_LENS_Q), max(CUDA_LENS_K), None, is_causal, "sm80", None, *window)
    out, lse = ops.varlen_fwd(q.cuda(), k.cuda(), v.cuda(), *args)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, is_causal, window)
    # PyTorch's bf16 rounding of the reference itself bounds what bf16 output can reach.
    floor = (ref.to(torch.bfloat16).double() - ref).abs().max().item()
    err = (out.cpu().double() - ref).abs().max().item()
    assert err <= 2 * floor + 1e-2, (err, floor)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.cpu().isfinite(), finite)
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], atol=2e-2, rtol=1e-3)
    assert (out[-5:] == 0).all()


@pytest.mark.gpu
def test_cuda_families_say_what_they_cannot():
    _cuda()
    q, k, v, cu_q, cu_k = (t.cuda() for t in packed(LENS_Q, LENS_K, e=64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="cu_seq_q must be an int32 tensor"):
        ops.varlen_fwd(q, k, v, cu_q.long(), cu_k, 33, 40, None, False, "sm80")
    with pytest.raises(RuntimeError, match="family is None"):
        ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40)
    out, lse = ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40, None, False, "sm80")
    if torch.cuda.get_device_capability() == (9, 0):
        with pytest.raises(RuntimeError, match="family='sm90' has no forward kernel that reads per-sequence"):
            ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40, None, False, "sm90")
        with pytest.raises(RuntimeError, match="family='sm90' has no backward kernel that reads per-sequence"):
            ops.varlen_bwd(out, q, k, v, out, lse, cu_q, cu_k, 33, 40, None, False, "sm90")
    with pytest.raises(RuntimeError, match=r"lse must be a float32 tensor of shape \(4, 65\)"):
        ops.varlen_bwd(out, q, k, v, out, lse[:, :-1], cu_q, cu_k, 33, 40, None, False, "sm80")


def _cuda_grads(q, k, v, cu_q, cu_k, is_causal, window, family="sm80"):
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    max_q, max_k = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    out, lse = ops.varlen_fwd(*leaves, cu_q.cuda(), cu_k.cuda(), max_q, max_k, None, is_causal, family, family,
                              *window)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype).cuda()
    return out, lse, torch.autograd.grad(out, leaves, dout), dout


def _reference_grads(q, k, v, cu_q, cu_k, is_causal, window, dout, compute):
    """The reference's output and gradients: float64 on the CPU, or the
    inputs' dtype on the GPU (the baseline)."""
    device = "cpu" if compute == torch.float64 else "cuda"
    leaves = [t.to(device).to(compute if compute == torch.float64 else t.dtype).requires_grad_() for t in (q, k, v)]
    out, _ = reference(*leaves, cu_q, cu_k, is_causal, window, compute=compute)
    return out, torch.autograd.grad(out, leaves, dout.to(device, out.dtype))


def _check_grads(ours, q, k, v, cu_q, cu_k, is_causal, window):
    out, _, grads, dout = ours
    ref, ref_grads = _reference_grads(q, k, v, cu_q, cu_k, is_causal, window, dout, torch.float64)
    base, base_grads = _reference_grads(q, k, v, cu_q, cu_k, is_causal, window, dout, q.dtype)
    assert_within_baseline("out", out.cpu(), base.cpu(), ref, floor=1e-3)
    for name, g, b, r in zip(("dq", "dk", "dv"), grads, base_grads, ref_grads):
        assert_within_baseline(name, g.cpu(), b.cpu(), r, floor=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_causal,window", CASES, ids=lambda c: str(c))
def test_cuda_sm80_backward_matches_float64(is_causal, window, head_dim):
    """sm80's backward on a packed batch (empty sequences, L != S, GQA, odd
    lengths, rows no sequence covers): output and gradients within twice the
    error of the same attention in bf16 math. Rows and keys no sequence reads
    get a gradient of 0."""
    _cuda()
    q, k, v, cu_q, cu_k = packed(CUDA_LENS_Q, CUDA_LENS_K, hq=8, hkv=2, e=head_dim, dtype=torch.bfloat16, spare_q=5)
    ours = _cuda_grads(q, k, v, cu_q, cu_k, is_causal, window)
    _check_grads(ours, q, k, v, cu_q, cu_k, is_causal, window)
    dq, dk, dv = ours[2]
    assert (dq[-5:] == 0).all()  # no sequence covers these rows
    assert (dk[:9] == 0).all() and (dv[:9] == 0).all()  # sequence 0 has keys and no queries


@pytest.mark.gpu
def test_cuda_sm80_many_sequences_and_one_long():
    """A thousand short sequences around one of 3000 tokens, fp16, MHA."""
    _cuda()
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 40, (1000,), generator=g).tolist()
    lens[500] = 3000
    q, k, v, cu_q, cu_k = packed(lens, lens, hq=2, hkv=2, e=64, dtype=torch.float16, seed=4)
    ours = _cuda_grads(q, k, v, cu_q, cu_k, True, (-1, -1))
    _check_grads(ours, q, k, v, cu_q, cu_k, True, (-1, -1))


@pytest.mark.gpu
def test_cuda_sm80_backward_deterministic():
    """Under use_deterministic_algorithms the packed backward sums dQ in a fixed
    order: two runs give the same bits, close to the default order's."""
    _cuda()
    q, k, v, cu_q, cu_k = packed(CUDA_LENS_Q, CUDA_LENS_K, hq=8, hkv=2, e=64, dtype=torch.bfloat16)
    default = _cuda_grads(q, k, v, cu_q, cu_k, True, (-1, -1))[2]
    with testing.deterministic_algorithms():
        first = _cuda_grads(q, k, v, cu_q, cu_k, True, (-1, -1))[2]
        second = _cuda_grads(q, k, v, cu_q, cu_k, True, (-1, -1))[2]
    for a, b, c in zip(first, second, default):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("window_size", [(-1, -1), (-1, 0), (64, 0)])
def test_cuda_provider_serves_varlen_attn(window_size):
    """torch.nn.attention.varlen.varlen_attn with our provider active: the
    forward and backward run our packed kernels (stats name them), within the
    2x rule of the float64 reference."""
    _cuda()
    from torch.nn import attention as A
    from torch.nn.attention.varlen import varlen_attn
    q, k, v, cu_q, cu_k = packed(CUDA_LENS_Q[1:], CUDA_LENS_Q[1:], hq=8, hkv=8, e=128, dtype=torch.bfloat16)
    is_causal, window = window_size == (-1, 0), window_size
    max_len = max(CUDA_LENS_Q)
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    tfb.reset_stats()
    A.activate_flash_attention_impl("torch_flash_backend")
    try:
        # sm80 alone: on Hopper the router leaves packed batches to PyTorch's kernel, faster than sm80's there.
        with testing.kernel_families("sm80"):
            out = varlen_attn(*leaves, cu_q.cuda(), cu_k.cuda(), max_len, max_len, window_size=window_size)
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, leaves, dout)
    finally:
        A.restore_flash_attention_impl()
    routed = tfb.stats()["routed"]
    assert any(name.startswith("sm80_fwd_bf16_hdim128") for name in routed), routed
    assert any(name.startswith("sm80_bwd_bf16_hdim128") for name in routed), routed
    _check_grads((out, None, grads, dout), q, k, v, cu_q, cu_k, is_causal, window)


@pytest.mark.gpu
def test_cuda_bad_offset_values_stay_inside_the_tensors():
    """The CUDA ops never read the offsets on the host (no sync): wrong values
    (past the tokens, falling, negative, a sequence longer than max_q) give
    garbage results but every kernel reads and writes inside q, k, v and the
    outputs (scripts/sanitize_small.py varlen runs these under memcheck), and
    the GPU stays usable: a correct call afterwards matches the reference."""
    _cuda()
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, e=64, dtype=torch.bfloat16)
    qc, kc, vc = (t.cuda() for t in (q, k, v))
    falling = torch.tensor([0, 5, 3, 20, 21, 54, 65], dtype=torch.int32)
    for bad_q, bad_k, max_q in [(cu_q, cu_k + 1000, 33), (falling, cu_k, 33), (cu_q - 7, cu_k, 33), (cu_q, cu_k, 8)]:
        out, lse = ops.varlen_fwd(qc, kc, vc, bad_q.cuda(), bad_k.cuda(), max_q, 40, None, True, "sm80")
        ops.varlen_bwd(torch.ones_like(out), qc, kc, vc, out, lse, bad_q.cuda(), bad_k.cuda(), max_q, 40, None, True,
                       "sm80")
    torch.cuda.synchronize()
    out, _ = ops.varlen_fwd(qc, kc, vc, cu_q.cuda(), cu_k.cuda(), 33, 40, None, True, "sm80")
    ref, _ = reference(q, k, v, cu_q, cu_k, True)
    assert (out.cpu().double() - ref).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_cuda_unwritten_rows_are_cleared():
    """Rows before the first sequence and after the last, and keys past
    seqused_k, are 0 (lse -inf) although the ops allocate outputs uninitialised:
    poisoned memory from an earlier allocation does not show through."""
    _cuda()
    lens_q, lens_k = [5, 0, 17], [7, 3, 17]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, e=64, dtype=torch.bfloat16, spare_q=4)
    pad = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    q = torch.cat([pad, q])  # rows 0-1 before the first sequence, 4 after the last
    cu_q = cu_q + 2
    used = torch.tensor([4, 3, 10], dtype=torch.int32)
    for _ in range(3):  # leave NaN in the caching allocator's blocks
        torch.full((q.numel() * 8,), float("nan"), device="cuda", dtype=torch.bfloat16)
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    out, lse = ops.varlen_fwd(*leaves, cu_q.cuda(), cu_k.cuda(), 17, 17, None, True, "sm80", "sm80",
                              seqused_k=used.cuda())
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn_like(out))
    ref, _ = reference(q, k, v, cu_q, cu_k, True, used=used)
    assert (out.cpu().double() - ref).abs().max().item() < 2e-2
    assert (out[:2] == 0).all() and (out[-4:] == 0).all() and (lse[:, :2] == -math.inf).all()
    assert (lse[:, -4:] == -math.inf).all() and (dq[:2] == 0).all() and (dq[-4:] == 0).all()
    for t in (dk, dv):  # keys past seqused_k: 4-6 of sequence 0, 20-26 of sequence 2
        assert (t[4:7] == 0).all() and (t[20:27] == 0).all() and t.isfinite().all()


@pytest.mark.gpu
def test_cuda_enable_serves_varlen_attn():
    """varlen_attn inside enable(): our packed forward; its backward runs ours
    too, although autograd runs it outside the block (and on its own thread)."""
    _cuda()
    from torch.nn.attention.varlen import varlen_attn
    lens = CUDA_LENS_Q[1:]
    q, k, v, cu_q, cu_k = packed(lens, lens, hq=4, hkv=4, e=64, dtype=torch.bfloat16, seed=5)
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    tfb.reset_stats()
    with tfb.enable(strict=True):
        out = varlen_attn(*leaves, cu_q.cuda(), cu_k.cuda(), max(lens), max(lens), window_size=(-1, 0))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    routed = tfb.stats()["routed"]
    assert any(n.startswith("sm80_fwd_bf16_hdim64") for n in routed), routed
    assert any(n.startswith("sm80_bwd_bf16_hdim64") for n in routed), routed
    _check_grads((out, None, grads, dout), q, k, v, cu_q, cu_k, True, (-1, 0))
    # Outside enable(), PyTorch's kernels serve the same call.
    tfb.reset_stats()
    varlen_attn(*leaves, cu_q.cuda(), cu_k.cuda(), max(lens), max(lens), window_size=(-1, 0)).sum().backward()
    assert not tfb.stats()["routed"], tfb.stats()
    # Lenient enable() on Hopper leaves it to PyTorch's kernel too (faster than sm80's there), saying why.
    with tfb.enable():
        varlen_attn(*leaves, cu_q.cuda(), cu_k.cuda(), max(lens), max(lens), window_size=(-1, 0))
    if torch.cuda.get_device_capability() == (9, 0):
        assert not tfb.stats()["routed"] and any("reads none" in r for r in tfb.stats()["fallback"]), tfb.stats()
    else:
        assert tfb.stats()["routed"], tfb.stats()


@pytest.mark.gpu
def test_cuda_enable_serves_jagged_sdpa():
    """SDPA on nested jagged tensors inside enable(): our packed kernels (the
    flash ops with offsets); strict mode raises for a head dim we lack."""
    _cuda()
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(6)
    lens = [37, 1, 300, 64]
    heads, e = 4, 64

    def jagged(dim):
        parts = [torch.randn(n, heads, dim, generator=g).to(torch.bfloat16).cuda() for n in lens]
        return torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)

    q, k, v = jagged(e), jagged(e), jagged(e)
    tfb.reset_stats()
    with tfb.enable(strict=True):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    out.transpose(1, 2).values().float().square().sum().backward()
    routed = tfb.stats()["routed"]
    assert any(n.startswith("sm80_fwd_bf16_hdim64") for n in routed), routed
    assert any(n.startswith("sm80_bwd_bf16_hdim64") for n in routed), routed
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    flat = [t.values().detach().cpu() for t in (q, k, v)]

    def grads_of(compute, device):
        leaves = [t.to(device, compute if compute == torch.float64 else t.dtype).requires_grad_() for t in flat]
        o, _ = reference(*leaves, cu, cu, True, compute=compute)
        o.float().square().sum().backward()
        return o.detach().cpu(), [t.grad.cpu() for t in leaves]

    ref, ref_grads = grads_of(torch.float64, "cpu")
    base, base_grads = grads_of(torch.bfloat16, "cuda")
    assert_within_baseline("out", out.transpose(1, 2).values().detach().cpu(), base, ref, floor=1e-3)
    for name, t, b, r in zip(("dq", "dk", "dv"), (q, k, v), base_grads, ref_grads):
        assert_within_baseline(name, t.grad.values().cpu(), b, r, floor=1e-3)
    q80, k80, v80 = jagged(80), jagged(80), jagged(80)
    with tfb.enable(strict=True), pytest.raises(tfb.UnsupportedError, match="head dim 80"):
        F.scaled_dot_product_attention(q80.transpose(1, 2), k80.transpose(1, 2), v80.transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="a compiled graph's varlen_attn call does not reach the packed switch: "
                   "inside enable() it ran PyTorch's kernel, and stats() counted nothing (measured on an H100)")
def test_cuda_compiled_varlen_attn_inside_and_outside_enable():
    """torch.compile(fullgraph=True) of a function calling varlen_attn: run
    inside enable() its packed calls should reach our kernels, outside it
    PyTorch's; the same numbers."""
    _cuda()
    from torch.nn.attention.varlen import varlen_attn
    lens = CUDA_LENS_Q[1:]
    q, k, v, cu_q, cu_k = (t.cuda() for t in packed(lens, lens, hq=4, hkv=4, e=64, dtype=torch.bfloat16, seed=8))

    @torch.compile(fullgraph=True)
    def attend(q, k, v):
        return varlen_attn(q, k, v, cu_q, cu_k, max(lens), max(lens), window_size=(-1, 0)) * 2

    tfb.reset_stats()
    plain = attend(q, k, v)
    assert not tfb.stats()["routed"], tfb.stats()
    with tfb.enable(strict=True):
        ours = attend(q, k, v)
    assert any(n.startswith("sm80_fwd_bf16_hdim64") for n in tfb.stats()["routed"]), tfb.stats()
    torch.testing.assert_close(ours, plain, atol=2e-2, rtol=2e-2)
