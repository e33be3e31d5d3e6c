"""The packed variable-length ops on the GPU: each family's forward and
backward per sequence against float64 (empty sequences, L != S, GQA, windows,
odd lengths, a million tokens), other sequences' values kept out, wrong
offsets kept inside the tensors, and varlen_attn / nested jagged SDPA served
through the provider hook and enable(). Helpers and the CPU side: test_varlen.py."""
import math

import pytest
import torch

import torch_flash_backend as tfb
from torch_flash_backend import testing

from reference import assert_within_baseline
from test_varlen import CASES, LENS_K, LENS_Q, packed, reference

ops = torch.ops.torch_flash_backend


def _cuda(family="sm80"):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on compute capability 9.0 alone")


def _routed_family():
    """The family the router gives packed batches here: Hopper's own, else sm80."""
    return "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80"


# The families that read packed batches, with the head dims each tests: every
# tile shape of sm90's (forward: 64 has three consumer warpgroups, 192 and 256
# stage O in Q's buffer; backward: 192 and 256 split the head dim).
FAMILY_CASES = [("sm80", 64), ("sm80", 128)] + [("sm90", d) for d in (64, 80, 96, 128, 192, 256)]


CUDA_LENS_Q = [0, 130, 1, 77, 300, 64, 5]
CUDA_LENS_K = [9, 200, 0, 77, 257, 64, 700]


@pytest.mark.gpu
@pytest.mark.parametrize("family,head_dim", FAMILY_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("is_causal,window", CASES, ids=lambda c: str(c))
def test_cuda_forward_matches_float64(is_causal, window, family, head_dim):
    """A forward on a packed batch (empty sequences, L != S, GQA, odd
    lengths): within twice PyTorch's own bf16 error against float64 per row,
    plus a floor, with poisoned outputs impossible (the op allocates them)."""
    _cuda(family)
    q, k, v, cu_q, cu_k = packed(CUDA_LENS_Q, CUDA_LENS_K, hq=8, hkv=2, e=head_dim, dtype=torch.bfloat16, spare_q=5)
    args = (cu_q.cuda(), cu_k.cuda(), max(CUDA_LENS_Q), max(CUDA_LENS_K), None, is_causal, family, None, *window)
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
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_cuda_other_sequences_values_never_reach_a_sequence(family):
    """A tile past a sequence's end reads the next sequence's rows (sm90 loads
    whole tiles): inf and NaN there, in q, k, v and dout, leave every other
    sequence's output, lse and gradients bit for bit as they were (deterministic
    mode: dQ summed in a fixed order)."""
    _cuda(family)
    lens = [70, 5, 130, 1, 64, 200]
    q, k, v, cu_q, cu_k = packed(lens, lens, hq=4, hkv=2, e=128, dtype=torch.bfloat16, seed=9)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.dtype)
    cu_q, cu_k = cu_q.cuda(), cu_k.cuda()

    def run(q, k, v, dout):
        leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
        out, lse = ops.varlen_fwd(*leaves, cu_q, cu_k, max(lens), max(lens), None, False, family, family)
        with testing.deterministic_algorithms():
            return (out, lse, *torch.autograd.grad(out, leaves, dout.cuda()))

    clean = run(q, k, v, dout)
    for poisoned in (2, 3, 5):  # after partial tiles of 5, 70 and 64 rows; the last
        rows = slice(int(cu_q[poisoned]), int(cu_q[poisoned + 1]))
        bad = [t.clone() for t in (q, k, v, dout)]
        for t, value in zip(bad, (math.inf, -math.inf, math.nan, math.inf)):
            t[rows] = value
        keep = torch.ones(q.size(0), dtype=torch.bool, device="cuda")
        keep[rows] = False
        for name, ours, expected in zip(("out", "lse", "dq", "dk", "dv"), run(*bad), clean):
            if name == "lse":
                ours, expected = ours.t(), expected.t()
            assert torch.equal(ours[keep], expected[keep]), (name, poisoned)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("used", [False, True])
def test_cuda_decode_reads_packed_short_queries(head_dim, is_causal, used):
    """The decode family on a packed batch of short queries (0-16 per sequence,
    keys 0-700, GQA), bottom-right per sequence, with and without seqused_k:
    within twice PyTorch's bf16 error against float64; the rows no sequence
    covers are 0."""
    _cuda()
    lens_q, lens_k = [1, 0, 16, 3, 9, 1, 5], [200, 7, 700, 0, 64, 33, 5]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, hq=8, hkv=2, e=head_dim, dtype=torch.bfloat16, spare_q=3, seed=12)
    seqused = torch.tensor([150, 7, 700, 0, 1, 33, 2], dtype=torch.int32) if used else None
    out, lse = ops.varlen_fwd(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(), max(lens_q), max(lens_k), None,
                              is_causal, "decode", seqused_k=None if seqused is None else seqused.cuda())
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, is_causal, used=seqused)
    floor = (ref.to(torch.bfloat16).double() - ref).abs().max().item()
    assert (out.cpu().double() - ref).abs().max().item() <= 2 * floor + 1e-2
    finite = ref_lse.isfinite()
    assert torch.equal(lse.cpu().isfinite(), finite)
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], atol=2e-2, rtol=1e-3)
    assert (out[-3:] == 0).all()


@pytest.mark.gpu
def test_cuda_families_say_what_they_cannot():
    _cuda()
    q, k, v, cu_q, cu_k = (t.cuda() for t in packed(LENS_Q, LENS_K, e=64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="cu_seq_q must be an int32 tensor"):
        ops.varlen_fwd(q, k, v, cu_q.long(), cu_k, 33, 40, None, False, "sm80")
    with pytest.raises(RuntimeError, match="family is None"):
        ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40)
    out, lse = ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40, None, False, "sm80")
    with pytest.raises(RuntimeError, match="family='decode' cannot run these inputs"):
        ops.varlen_fwd(q, k, v, cu_q, cu_k, 33, 40, None, False, "decode")  # queries past its 16
    with pytest.raises(RuntimeError, match=r"lse must be a float32 tensor of shape \(4, 65\)"):
        ops.varlen_bwd(out, q, k, v, out, lse[:, :-1], cu_q, cu_k, 33, 40, None, False, "sm80")


def _cuda_grads(q, k, v, cu_q, cu_k, is_causal, window, family="sm80", backward_family="sm80"):
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    max_q, max_k = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    out, lse = ops.varlen_fwd(*leaves, cu_q.cuda(), cu_k.cuda(), max_q, max_k, None, is_causal, family,
                              backward_family, *window)
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
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("is_causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (200, 0))],
                         ids=lambda c: str(c))
def test_cuda_long_sequence_among_many_short(is_causal, window, family):
    """One 1500-token sequence among 90 short and empty ones (the backward's
    row kernels find each block's sequence by a search over the offsets):
    output and gradients within twice bf16 math's error against float64."""
    _cuda(family)
    g = torch.Generator().manual_seed(11)
    lens = [int(n) for n in torch.randint(0, 90, (90,), generator=g)]
    lens[5:8] = [0, 0, 0]
    lens.insert(40, 1500)
    q, k, v, cu_q, cu_k = packed(lens, lens, hq=4, hkv=2, e=64, dtype=torch.bfloat16, seed=12)
    ours = _cuda_grads(q, k, v, cu_q, cu_k, is_causal, window, family, family)
    _check_grads(ours, q, k, v, cu_q, cu_k, is_causal, window)


@pytest.mark.gpu
@pytest.mark.parametrize("family,head_dim", FAMILY_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("is_causal,window", CASES, ids=lambda c: str(c))
def test_cuda_backward_matches_float64(is_causal, window, family, head_dim):
    """A backward on a packed batch (empty sequences, L != S, GQA, odd
    lengths, rows no sequence covers): output and gradients within twice the
    error of the same attention in bf16 math. Rows and keys no sequence reads
    get a gradient of 0."""
    _cuda(family)
    q, k, v, cu_q, cu_k = packed(CUDA_LENS_Q, CUDA_LENS_K, hq=8, hkv=2, e=head_dim, dtype=torch.bfloat16, spare_q=5)
    ours = _cuda_grads(q, k, v, cu_q, cu_k, is_causal, window, family, family)
    _check_grads(ours, q, k, v, cu_q, cu_k, is_causal, window)
    dq, dk, dv = ours[2]
    assert (dq[-5:] == 0).all()  # no sequence covers these rows
    assert (dk[:9] == 0).all() and (dv[:9] == 0).all()  # sequence 0 has keys and no queries


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_cuda_many_sequences_and_one_long(family):
    """A thousand short sequences around one of 3000 tokens, fp16, MHA."""
    _cuda(family)
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 40, (1000,), generator=g).tolist()
    lens[500] = 3000
    q, k, v, cu_q, cu_k = packed(lens, lens, hq=2, hkv=2, e=64, dtype=torch.float16, seed=4)
    ours = _cuda_grads(q, k, v, cu_q, cu_k, True, (-1, -1), family, family)
    _check_grads(ours, q, k, v, cu_q, cu_k, True, (-1, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_cuda_a_million_tokens_in_thousands_of_sequences(family):
    """2600 causal sequences of 0-800 tokens, a million in all: sampled
    sequences (the longest, empty ones' neighbours, random ones) against float32
    attention of each alone."""
    _cuda(family)
    g = torch.Generator().manual_seed(11)
    lens = torch.randint(0, 801, (2600,), generator=g)
    lens[::97] = 0
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32).cuda()
    total = int(lens.sum())
    assert total >= 1_000_000
    q, k, v = (torch.randn(total, h, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    out, lse = ops.varlen_fwd(q, k, v, cu, cu, int(lens.max()), int(lens.max()), None, True, family)
    picks = {int(lens.argmax()), 1, 98, 2599} | set(torch.randint(0, 2600, (8,), generator=g).tolist())
    for b in sorted(picks):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.start == rows.stop:
            continue
        qb, kb, vb = (t[rows].transpose(0, 1).float() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out[rows].float(), ref.transpose(0, 1), atol=2e-2, rtol=2e-2, msg=str(b))


@pytest.mark.gpu
@pytest.mark.parametrize("family,head_dim", [("sm80", 64), ("sm90", 64), ("sm90", 256)])
def test_cuda_backward_deterministic(family, head_dim):
    """Under use_deterministic_algorithms the packed backward sums dQ in a fixed
    order: two runs give the same bits, close to the default order's."""
    _cuda(family)
    q, k, v, cu_q, cu_k = packed(CUDA_LENS_Q, CUDA_LENS_K, hq=8, hkv=2, e=head_dim, dtype=torch.bfloat16)
    default = _cuda_grads(q, k, v, cu_q, cu_k, True, (-1, -1), family, family)[2]
    with testing.deterministic_algorithms():
        first = _cuda_grads(q, k, v, cu_q, cu_k, True, (-1, -1), family, family)[2]
        second = _cuda_grads(q, k, v, cu_q, cu_k, True, (-1, -1), family, family)[2]
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
        out = varlen_attn(*leaves, cu_q.cuda(), cu_k.cuda(), max_len, max_len, window_size=window_size)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, dout)
    finally:
        A.restore_flash_attention_impl()
    routed = tfb.stats()["routed"]
    assert any(name.startswith(f"{_routed_family()}_fwd_bf16_hdim128") for name in routed), routed
    assert any(name.startswith(f"{_routed_family()}_bwd_bf16_hdim128") for name in routed), routed
    _check_grads((out, None, grads, dout), q, k, v, cu_q, cu_k, is_causal, window)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_cuda_bad_offset_values_stay_inside_the_tensors(family):
    """The CUDA ops never read the offsets on the host (no sync): wrong values
    (past the tokens, falling, negative, a sequence longer than max_q) give
    garbage results but every kernel reads and writes inside q, k, v and the
    outputs (scripts/sanitize_small.py varlen runs these under memcheck), and
    the GPU stays usable: a correct call afterwards matches the reference."""
    _cuda(family)
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, e=64, dtype=torch.bfloat16)
    qc, kc, vc = (t.cuda() for t in (q, k, v))
    falling = torch.tensor([0, 5, 3, 20, 21, 54, 65], dtype=torch.int32)
    overlapping = torch.tensor([0, 60, 0, 60, 0, 60, 65], dtype=torch.int32)  # more tiles than the tokens hold
    for bad_q, bad_k, max_q in [(cu_q, cu_k + 1000, 33), (falling, cu_k, 33), (cu_q - 7, cu_k, 33), (cu_q, cu_k, 8),
                                (overlapping, cu_k, 60)]:
        out, lse = ops.varlen_fwd(qc, kc, vc, bad_q.cuda(), bad_k.cuda(), max_q, 40, None, True, family)
        ops.varlen_bwd(torch.ones_like(out), qc, kc, vc, out, lse, bad_q.cuda(), bad_k.cuda(), max_q, 40, None, True,
                       family)
    torch.cuda.synchronize()
    out, _ = ops.varlen_fwd(qc, kc, vc, cu_q.cuda(), cu_k.cuda(), 33, 40, None, True, family)
    ref, _ = reference(q, k, v, cu_q, cu_k, True)
    assert (out.cpu().double() - ref).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_cuda_unwritten_rows_are_cleared(family):
    """Rows before the first sequence and after the last, and keys past
    seqused_k, are 0 (lse -inf) although the ops allocate outputs uninitialised:
    poisoned memory from an earlier allocation does not show through."""
    _cuda(family)
    lens_q, lens_k = [5, 0, 17], [7, 3, 17]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, e=64, dtype=torch.bfloat16, spare_q=4)
    pad = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    q = torch.cat([pad, q])  # rows 0-1 before the first sequence, 4 after the last
    cu_q = cu_q + 2
    used = torch.tensor([4, 3, 10], dtype=torch.int32)
    for _ in range(3):  # leave NaN in the caching allocator's blocks
        torch.full((q.numel() * 8,), float("nan"), device="cuda", dtype=torch.bfloat16)
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    out, lse = ops.varlen_fwd(*leaves, cu_q.cuda(), cu_k.cuda(), 17, 17, None, True, family, family,
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
    assert any(n.startswith(f"{_routed_family()}_fwd_bf16_hdim64") for n in routed), routed
    assert any(n.startswith(f"{_routed_family()}_bwd_bf16_hdim64") for n in routed), routed
    _check_grads((out, None, grads, dout), q, k, v, cu_q, cu_k, True, (-1, 0))
    # Outside enable(), PyTorch's kernels serve the same call.
    tfb.reset_stats()
    varlen_attn(*leaves, cu_q.cuda(), cu_k.cuda(), max(lens), max(lens), window_size=(-1, 0)).sum().backward()
    assert not tfb.stats()["routed"], tfb.stats()
    # Lenient enable() serves it too.
    with tfb.enable():
        varlen_attn(*leaves, cu_q.cuda(), cu_k.cuda(), max(lens), max(lens), window_size=(-1, 0))
    assert any(n.startswith(f"{_routed_family()}_fwd_bf16_hdim64") for n in tfb.stats()["routed"]), tfb.stats()


@pytest.mark.gpu
def test_cuda_packed_refusal_counts_once():
    """A packed call enable() leaves to PyTorch (dropout here) passes the
    autograd route and the switch below it; stats() counts it once, and a
    strict refusal once too."""
    _cuda()
    from torch.nn.attention.varlen import varlen_attn
    lens = CUDA_LENS_Q[1:]
    q, k, v, cu_q, cu_k = (t.cuda() for t in packed(lens, lens, hq=4, hkv=4, e=64, dtype=torch.bfloat16, seed=6))
    args = (q, k, v, cu_q, cu_k, max(lens), max(lens))
    tfb.reset_stats()
    with tfb.enable():
        torch.ops.aten._flash_attention_forward(*args, 0.5, False, False)
    assert not tfb.stats()["routed"] and sum(tfb.stats()["fallback"].values()) == 1, tfb.stats()
    tfb.reset_stats()
    with tfb.enable(strict=True), pytest.raises(tfb.UnsupportedError):
        torch.ops.aten._flash_attention_forward(*args, 0.5, False, False)
    assert sum(tfb.stats()["fallback"].values()) == 1, tfb.stats()
    # A served call counts once too.
    tfb.reset_stats()
    with tfb.enable():
        varlen_attn(*args)
    assert sum(tfb.stats()["routed"].values()) == 1 and not tfb.stats()["fallback"], tfb.stats()


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
    assert any(n.startswith(f"{_routed_family()}_fwd_bf16_hdim64") for n in routed), routed
    assert any(n.startswith(f"{_routed_family()}_bwd_bf16_hdim64") for n in routed), routed
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
    # A head dim between the built ones runs on the next larger kernel (test_head_dims.py), jagged too.
    q72, k72, v72 = jagged(72), jagged(72), jagged(72)
    tfb.reset_stats()
    with tfb.enable(strict=True):
        out72 = F.scaled_dot_product_attention(q72.transpose(1, 2), k72.transpose(1, 2), v72.transpose(1, 2))
    assert torch.isfinite(out72.values()).all()
    kernel = "hdim80" if _routed_family() == "sm90" else "hdim96"
    assert any(kernel in name for name in tfb.stats()["routed"]), tfb.stats()


@pytest.mark.gpu
def test_cuda_compiled_varlen_attn_inside_and_outside_enable():
    """torch.compile(fullgraph=True) of a function calling varlen_attn: compiled
    inside enable(), its graph calls our packed ops (forward and backward:
    stats count them at trace time); compiled outside, PyTorch's. The same
    numbers, and gradients within the 2x criterion."""
    _cuda()
    from torch.nn.attention.varlen import varlen_attn
    lens = CUDA_LENS_Q[1:]
    q, k, v, cu_q, cu_k = packed(lens, lens, hq=4, hkv=2, e=64, dtype=torch.bfloat16, seed=8)
    cu_q, cu_k = cu_q.cuda(), cu_k.cuda()

    @torch.compile(fullgraph=True)
    def attend(q, k, v):
        return varlen_attn(q, k, v, cu_q, cu_k, max(lens), max(lens), window_size=(-1, 0)) * 2

    def run():
        leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        out.float().square().sum().backward()
        return out.detach(), [t.grad for t in leaves]

    tfb.reset_stats()
    plain, plain_grads = run()
    assert not tfb.stats()["routed"], tfb.stats()
    with tfb.enable(strict=True):
        ours, our_grads = run()
        ours_again, _ = run()  # the graph compiled inside runs again without retracing
    routed = tfb.stats()["routed"]
    assert any(n.startswith(f"{_routed_family()}_fwd_bf16_hdim64") for n in routed), routed
    assert any(n.startswith(f"{_routed_family()}_bwd_bf16_hdim64") for n in routed), routed
    torch.testing.assert_close(ours_again, ours, atol=0, rtol=0)
    torch.testing.assert_close(ours, plain, atol=2e-2, rtol=2e-2)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*leaves64, cu_q.cpu(), cu_k.cpu(), True)
    (2 * ref).square().sum().backward()
    ref_grads = [t.grad for t in leaves64]
    assert_within_baseline("out", ours.cpu(), plain.cpu(), 2 * ref.detach(), floor=1e-3)
    for name, g, b, r in zip(("dq", "dk", "dv"), our_grads, plain_grads, ref_grads):
        assert_within_baseline(name, g.cpu(), b.cpu(), r, floor=1e-3)
    # Called outside enable() again, the first graph (PyTorch's kernels) runs.
    tfb.reset_stats()
    run()
    assert not tfb.stats()["routed"], tfb.stats()


@pytest.mark.gpu
def test_cuda_compiled_jagged_sdpa_inside_and_outside_enable():
    """torch.compile(fullgraph=True) of an attention module on nested jagged
    tensors: Dynamo keeps their lengths symbolic (backed), which enable()
    decides on without a guard: inside enable() the graph runs our packed
    kernels, forward and backward, one graph for batches of other lengths;
    outside, PyTorch's."""
    _cuda()
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(9)
    lens = [37, 1, 300, 64, 129]
    heads, e = 4, 64
    parts = [[torch.randn(n, heads, e, generator=g).to(torch.bfloat16) for n in lens] for _ in range(3)]

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True).transpose(1, 2)

    def run(attend):
        q, k, v = (torch.nested.nested_tensor([t.cuda() for t in p], layout=torch.jagged, requires_grad=True)
                   for p in parts)
        out = attend(q, k, v)
        out.values().float().square().sum().backward()
        return out.values().detach(), [t.grad.values() for t in (q, k, v)]

    attend = torch.compile(Attend(), fullgraph=True)
    tfb.reset_stats()
    plain, plain_grads = run(attend)
    assert not tfb.stats()["routed"], tfb.stats()
    torch._dynamo.reset()
    inside_attend = torch.compile(Attend(), fullgraph=True)
    with tfb.enable():
        inside, inside_grads = run(inside_attend)
    routed = tfb.stats()["routed"]
    assert any("_fwd_bf16_hdim64" in n for n in routed) and any("_bwd_bf16_hdim64" in n for n in routed), routed
    torch.testing.assert_close(inside, plain, atol=2e-2, rtol=2e-2)
    for a, b in zip(inside_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    # Other lengths (a longer longest sequence, more sequences): the same graph.
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    lens[:] = [5, 700, 33, 2, 90, 64]
    parts[:] = [[torch.randn(n, heads, e, generator=g).to(torch.bfloat16) for n in lens] for _ in range(3)]
    with tfb.enable():
        run(inside_attend)
    assert counters["stats"]["unique_graphs"] - graphs <= 1, dict(counters["stats"])
    with tfb.enable(strict=True):  # ours or an error: ours
        run(torch.compile(Attend(), fullgraph=True))


@pytest.mark.gpu
def test_cuda_compiled_jagged_sdpa_of_single_token_sequences():
    """A compiled jagged call whose every sequence is one token (max_seqlen 1,
    which Dynamo may specialise): each query sees its one key, so the output is
    exactly v and dq = dk = 0, dv = d(out); our packed kernels serve it under
    enable(strict=True), forward and backward, for one sequence and for five."""
    _cuda()
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(11)
    heads, e = 4, 64

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    compiled = torch.compile(attend, fullgraph=True)
    for count in (1, 5):
        parts = [[torch.randn(1, heads, e, generator=g).to(torch.bfloat16).cuda() for _ in range(count)]
                 for _ in range(3)]
        q, k, v = (torch.nested.nested_tensor(p, layout=torch.jagged, requires_grad=True) for p in parts)
        tfb.reset_stats()
        with tfb.enable(strict=True):
            out = compiled(q, k, v)
            out.values().float().square().sum().backward()
        routed = tfb.stats()["routed"]
        assert any("_fwd_bf16_hdim64" in n for n in routed) and any("_bwd_bf16_hdim64" in n for n in routed), routed
        values_v = torch.cat(parts[2]).float()
        # P is exp(0) = 1 up to rounding and dS = P (dP - rowsum(dO O)) nearly cancels
        torch.testing.assert_close(out.values().float(), values_v, atol=0, rtol=8e-3)
        for grad in (q.grad, k.grad):
            torch.testing.assert_close(grad.values().float(), torch.zeros_like(values_v), atol=1e-3, rtol=0)
        torch.testing.assert_close(v.grad.values().float(), 2 * values_v, atol=0, rtol=8e-3)
