"""The packed variable-length ops (varlen_fwd / varlen_bwd): per-sequence
results against a float64 reference on CPU and (GPU tests) CUDA, their
argument checks, opcheck, fake kernels, and PyTorch's varlen_attn served
through the provider hook. Sequences are bottom-right aligned, as
FlashAttention's varlen."""
import copy
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_flash_backend as tfb
from torch_flash_backend import _router, testing

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


def test_compiled_with_symbolic_longest_lengths():
    """max_q / max_k are SymInts in the ops' schemas: a function compiled with
    dynamic shapes passing them from the tensors' sizes traces once for every
    size (forward and backward), with the eager numbers."""
    torch._dynamo.reset()

    def attend(q, k, v, cu_q, cu_k):
        return ops.varlen_fwd(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], None, True)[0]

    compiled = torch.compile(attend, dynamic=True, fullgraph=True)
    counters = torch._dynamo.utils.counters
    counters.clear()
    for n in (7, 13, 30):
        q, k, v, cu_q, cu_k = packed([n], [n + 3], seed=n)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = compiled(*leaves, cu_q, cu_k)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        eager = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = attend(*eager, cu_q, cu_k)
        torch.testing.assert_close(out, ref)
        for a, b in zip(grads, torch.autograd.grad(ref.square().sum(), eager)):
            torch.testing.assert_close(a, b)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_symbolic_lengths_decide_without_guards():
    """decide_varlen on a compiled graph's symbolic sizes (total tokens, longest
    lengths): the choice of a long query, and no guard added to the graph."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
    env = ShapeEnv()

    def symbol(n, name):
        return env.create_symintnode(env.create_symbol(n, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC),
                                     hint=n)

    kernels = testing.registry_kernel_names("sm90") + testing.registry_kernel_names("decode")
    with FakeTensorMode(shape_env=env), testing.pretend_cuda(capability=(9, 0), kernels=kernels):
        total_q, total_k = symbol(300, "total_q"), symbol(400, "total_k")
        q = torch.empty(total_q, 4, 64, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(total_k, 4, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        offsets = torch.empty(6, dtype=torch.int32, device="cuda")
        d = _router.decide_varlen(q, k, v, offsets, offsets, symbol(100, "max_q"), symbol(5, "max_k"),
                                  is_causal=True, needs_grad=False)
        assert d.kernel == "sm90_fwd_bf16_hdim64", str(d)
    assert not env.guards, [str(g.expr) for g in env.guards]


def test_router_decides_packed_batches():
    """decide_varlen: the families whose records read per-sequence lengths
    serve a packed batch (sm80's and sm90's, not decode's); metadata
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
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=["decode_fwd_bf16_hdim64"]):
        q = torch.empty(70, 8, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        # The decode family reads short queries of a packed batch, and no longer ones.
        assert _router.decide_varlen(q, q, q, cu, cu, 8, 50).kernel == "decode_fwd_bf16_hdim64"
        assert not _router.decide_varlen(q, q, q, cu, cu, 40, 50).served
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=["sm90_fwd_bf16_hdim64"]):
        q = torch.empty(70, 8, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        assert _router.decide_varlen(q, q, q, cu, cu, 40, 50).kernel == "sm90_fwd_bf16_hdim64"
    both = testing.registry_kernel_names("sm90", "sm80")
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=both):
        q = torch.empty(70, 8, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        d = _router.decide_varlen(q, q, q, cu, cu, 40, 50, needs_grad=True)
        assert d.served and (d.kernel, d.backward_kernel) == ("sm90_fwd_bf16_hdim64", "sm90_bwd_bf16_hdim64"), d

        def reading_none(*names):  # these records ("sm90_fwd"), as if they read no packed batch
            records = set()
            for kernel in testing.fake_kernels(both):
                if f"{kernel.family}_{kernel.pass_}" in names:
                    kernel = copy.copy(kernel)
                    kernel.seqlens = False
                records.add(kernel)
            return frozenset(records)

        _router.probe.kernels = lambda: reading_none("sm90_fwd", "sm80_fwd")
        d = _router.decide_varlen(q, q, q, cu, cu, 40, 50)
        assert not d.served and "packed variable-length batch: no forward" in d.reason, d
        # Where the chip's first family reads none, enable() leaves it to PyTorch and strict takes the next.
        _router.probe.kernels = lambda: reading_none("sm90_fwd", "sm90_bwd")
        d = _router.decide_varlen(q, q, q, cu, cu, 40, 50)
        assert not d.served and "the sm90 family, this chip's first, reads none" in d.reason, d
        assert _router.decide_varlen(q, q, q, cu, cu, 40, 50, pinned=True).kernel == "sm80_fwd_bf16_hdim64"
        # A backward that reads none passes the batch's gradient to the next family that does; none: PyTorch.
        _router.probe.kernels = lambda: reading_none("sm90_bwd")
        d = _router.decide_varlen(q, q, q, cu, cu, 40, 50, needs_grad=True)
        assert d.served and d.backward_kernel == "sm80_bwd_bf16_hdim64", d
        _router.probe.kernels = lambda: reading_none("sm90_bwd", "sm80_bwd")
        d = _router.decide_varlen(q, q, q, cu, cu, 40, 50, needs_grad=True)
        assert not d.served and d.reason == _router.PACKED_GRAD_REASON, d


def test_explain_varlen_says_what_enable_would_do():
    """tfb.explain_varlen: varlen_attn's arguments, enable()'s decision, lenient and strict."""
    both = testing.registry_kernel_names("sm90", "sm80")
    with FakeTensorMode(), testing.pretend_cuda(capability=(9, 0), kernels=both):
        q = torch.empty(70, 8, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        lenient = tfb.explain_varlen(q, q, q, cu, cu, 40, 40, window_size=(-1, 0))
        assert lenient.served and lenient.kernel == "sm90_fwd_bf16_hdim64" and "causal" in lenient.reason
        q32 = torch.empty(70, 8, 32, dtype=torch.bfloat16, device="cuda")  # sm90 has no head dim 32
        strict = tfb.explain_varlen(q32, q32, q32, cu, cu, 40, 40, window_size=(-1, 0), strict=True)
        assert strict.served and strict.kernel == "sm80_fwd_bf16_hdim32" and "causal" in strict.reason
        windowed = tfb.explain_varlen(q, q, q, cu, cu, 40, 40, window_size=(16, 0), strict=True)
        assert "window (16, 0)" in windowed.reason and "causal" not in windowed.reason


def test_explain_reads_nested_jagged_sdpa_as_the_packed_call():
    """tfb.explain on nested jagged tensors: the decision for the packed call
    SDPA's flash backend makes of them (here on the CPU route, whose ops read
    packed batches too), and why not where it cannot."""
    g = torch.Generator().manual_seed(0)

    def jagged(e=64):
        parts = [torch.randn(n, 4, e, generator=g) for n in (37, 1, 300)]
        return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)

    q, k, v = jagged(), jagged(), jagged()
    with testing.route_cpu():
        d = tfb.explain(q, k, v, is_causal=True)
        assert d.served and "packed batch of 3 sequences" in d.reason and "bottom-right" in d.reason, d
        assert "must all be nested" in tfb.explain(q, k, v.values().unsqueeze(0).transpose(1, 2)).reason
        assert "attn_mask" in tfb.explain(q, k, v, attn_mask=torch.ones(1, dtype=torch.bool)).reason


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
