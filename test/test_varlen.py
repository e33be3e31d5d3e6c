"""The packed variable-length ops (varlen_fwd / varlen_bwd) on CPU: per-sequence
results against a float64 reference, their argument checks, opcheck and fake
kernels. Sequences are bottom-right aligned, as FlashAttention's varlen."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_flash_backend  # noqa: F401  (the ops)

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


def reference(q, k, v, cu_q, cu_k, is_causal=False, window=(-1, -1), scale=None, used=None):
    """float64 attention per sequence, bottom-right aligned; rows that see no
    key give 0 and lse -inf."""
    hq, e = q.size(1), q.size(2)
    group = hq // k.size(1)
    scale = 1 / math.sqrt(e) if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((hq, q.size(0)), -math.inf, dtype=torch.float64)
    for b in range(cu_q.numel() - 1):
        q0, length = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b])
        k0 = int(cu_k[b])
        s = int(used[b]) if used is not None else int(cu_k[b + 1] - cu_k[b])
        if length == 0 or s == 0:
            continue
        qb = q[q0:q0 + length].double().transpose(0, 1)
        kb = k[k0:k0 + s].double().repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[k0:k0 + s].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qb @ kb.transpose(1, 2) * scale
        i = torch.arange(length).view(-1, 1) + (s - length)
        j = torch.arange(s).view(1, -1)
        visible = torch.ones(length, s, dtype=torch.bool)
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
def test_cuda_families_and_backward_say_what_they_cannot():
    _cuda()
    q, k, v, cu_q, cu_k = (t.cuda() for t in packed(LENS_Q, LENS_K, e=64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="cu_seq_q must be an int32 tensor"):
        ops.varlen_fwd(q, k, v, cu_q.long(), cu_k, 33, 40, None, False, "sm80")
    with pytest.raises(RuntimeError, match="family is None"):
        ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40)
    if torch.cuda.get_device_capability() == (9, 0):
        with pytest.raises(RuntimeError, match="family='sm90' cannot run these inputs"):
            ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40, None, False, "sm90")
    out, lse = ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40, None, False, "sm80")
    with pytest.raises(RuntimeError, match="no CUDA backward reads packed variable-length batches"):
        ops.varlen_bwd(out, q, k, v, out, lse, cu_q, cu_k, 33, 40, None, False, "sm80")


@pytest.mark.gpu
def test_cuda_bad_offset_values_raise_before_any_kernel():
    """Offsets whose values are wrong (falling, past the packed tensors, above
    max_q) raise naming the argument; the GPU stays usable."""
    _cuda()
    q, k, v, cu_q, cu_k = (t.cuda() for t in packed(LENS_Q, LENS_K, e=64, dtype=torch.bfloat16))
    for name, bad_q, bad_k, message in [
        ("past the keys", cu_q, cu_k + 1000, "cu_seq_k must rise"),
        ("falling", torch.tensor([0, 5, 3, 20, 21, 54, 65], dtype=torch.int32, device="cuda"), cu_k,
         "cu_seq_q must rise"),
        ("negative", cu_q - 1, cu_k, "cu_seq_q must rise"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            ops.varlen_fwd(q, k, v, bad_q, bad_k, 33, 40, None, False, "sm80")
    with pytest.raises(RuntimeError, match=r"max_q \(8\) is below"):
        ops.varlen_fwd(q, k, v, cu_q, cu_k, 8, 40, None, False, "sm80")
    out, _ = ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40, None, False, "sm80")
    torch.cuda.synchronize()
    assert out.isfinite().all()
