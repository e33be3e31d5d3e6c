"""FP8 attention on the GPU: the sm90 family's e4m3 forward against the float64
attention of the dequantized inputs, within twice the error of a float32
emulation that rounds the probabilities to e4m3 (per head, per-head amplitudes
from 0.01 to 100, outlier features), descales of 0 and huge, packed batches,
and PyTorch's quantized SDPA served through the provider and enable()."""
import math
import warnings

import pytest
import torch
from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

import torch_flash_backend as tfb

ops = torch.ops.torch_flash_backend
FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 kernel runs on compute capability 9.0 alone")


def _quantize(x: torch.Tensor, group: int):
    """(B, H, L, E) float32 -> e4m3 values and (B, H // group) float32 descales
    (amax / 448 over each kv head's group of heads)."""
    b, h = x.shape[:2]
    amax = x.abs().reshape(b, h // group, -1).amax(-1).clamp_min(1e-12)
    descale = (amax / E4M3_MAX).float()
    per_head = descale.repeat_interleave(group, dim=1)[..., None, None]
    return (x / per_head).to(FP8), descale


def _dequantize(x8: torch.Tensor, descale: torch.Tensor, group: int) -> torch.Tensor:
    return x8.double() * descale.double().repeat_interleave(group, dim=1)[..., None, None]


def _inputs(b, hq, hkv, lq, lk, e, seed, outliers=True):
    """float32 (B, H, L, E) q, k, v: q and v with per-head amplitudes from 0.01
    to 100, k with the inverse of its group's largest (so that the scores stay
    in a softmax's useful range: FP8 wgmma accumulates with fewer bits than
    float32, and scores of 1e9 would measure that, not the kernel), and a few
    outlier features 20x the rest in q and k."""
    g = torch.Generator().manual_seed(seed)
    amp_q = torch.logspace(-2, 2, hq)
    amp_k = 1 / amp_q.reshape(hkv, -1).amax(-1)
    amp_v = torch.logspace(-2, 2, hkv)

    def one(amp, length, spiky):
        x = torch.randn(b, amp.numel(), length, e, generator=g)
        if spiky and outliers:
            x[..., :: max(1, e // 4)] *= 20
        return x * amp[None, :, None, None]

    return one(amp_q, lq, True), one(amp_k, lk, True), one(amp_v, lk, False)


def _mask(lq, lk, is_causal):
    if not is_causal:
        return None
    # PyTorch's flash ops (and fp8_fwd's bottom_right): the last query row meets the last key.
    return torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)


def _expand(x, group):
    return x.repeat_interleave(group, dim=1)


def _float64_reference(qd, kd, vd, scale, is_causal, group):
    s = scale * qd @ _expand(kd, group).transpose(-1, -2)
    m = _mask(qd.size(2), kd.size(2), is_causal)
    if m is not None:
        s = s.masked_fill(~m, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ _expand(vd, group), lse


def _float32_emulation(qd, kd, vd, scale, is_causal, group):
    """The kernel's arithmetic in float32, probabilities rounded to e4m3 before P V."""
    q, k, v = qd.float(), _expand(kd, group).float(), _expand(vd, group).float()
    s = scale * q @ k.transpose(-1, -2)
    m = _mask(q.size(2), k.size(2), is_causal)
    if m is not None:
        s = s.masked_fill(~m, -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p.to(FP8).float() @ v) / p.sum(-1, keepdim=True)


def _per_head_max(x):
    return x.abs().flatten(2).amax(-1)


def _tensor_core_emulation(q8, qs, k8, ks, vd, scale, is_causal, group):
    """_float32_emulation with the scores from PyTorch's own FP8 matmul
    (torch._scaled_mm, FP8 tensor cores: the dot products the kernel's wgmma
    makes, whose accumulation keeps fewer bits than float32)."""
    b, hq, lq, e = q8.shape
    lk = k8.size(2)
    pad = lambda n: -n % 16  # noqa: E731  (_scaled_mm wants multiples of 16)
    one = torch.ones((), device="cuda")
    s = torch.empty(b, hq, lq, lk)
    for bi in range(b):
        for h in range(hq):
            a = torch.nn.functional.pad(q8[bi, h].view(torch.uint8), (0, 0, 0, pad(lq))).view(FP8).cuda()
            kt = torch.nn.functional.pad(k8[bi, h // group].view(torch.uint8), (0, 0, 0, pad(lk))).view(FP8).cuda()
            s[bi, h] = torch._scaled_mm(a, kt.t(), one, one, out_dtype=torch.float32)[:lq, :lk].cpu()
    s = s * (qs.repeat_interleave(group, 1) * ks.repeat_interleave(group, 1))[..., None, None] * scale
    m = _mask(lq, lk, is_causal)
    if m is not None:
        s = s.masked_fill(~m, -math.inf)
    top = s.amax(-1, keepdim=True)
    p = torch.exp(s - top)
    # Head dim 64 sums P as P V reads it (times 256, rounded to e4m3) into
    # O's last column: its lse is that sum's.
    rounded_sum = (p * 256).to(FP8).float().sum(-1) / 256
    lse_rounded = top.squeeze(-1) + torch.log(rounded_sum)
    out = (p.to(FP8).float() @ _expand(vd, group).float()) / p.sum(-1, keepdim=True)
    return out, torch.logsumexp(s, -1), lse_rounded


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(333, 517), (256, 256), (1, 700)])
def test_cuda_fp8_error_against_the_emulations(head_dim, is_causal, lq, lk):
    """Against the float64 attention of the dequantized inputs, per head: the
    kernel's error is within 2x that of a float32 emulation rounding P to e4m3
    on heads whose scaled scores stay within +-250, and within 2.5x that
    of the same emulation on scores from the FP8 tensor cores everywhere
    (cuBLAS sums them in another order: another sample of the same rounding,
    measured at up to 1.95x the kernel's or below it).
    Where a head's softmax is sharp enough (here q's largest amplitude over
    k's smallest with 20x outlier features in both, logits in the hundreds),
    the tensor cores' accumulation of Q K^T alone costs more than 2x the
    float32 emulation (measured: torch._scaled_mm's scores give the kernel's
    error)."""
    _hopper()
    b, hq, hkv = 2, 8, 2
    group = hq // hkv
    q, k, v = _inputs(b, hq, hkv, lq, lk, head_dim, seed=head_dim + lq)
    (q8, qs), (k8, ks), (v8, vs) = _quantize(q, group), _quantize(k, 1), _quantize(v, 1)
    qd, kd, vd = _dequantize(q8, qs, group), _dequantize(k8, ks, 1), _dequantize(v8, vs, 1)
    scale = head_dim ** -0.5
    ref, ref_lse = _float64_reference(qd, kd, vd, scale, is_causal, group)
    emul = _float32_emulation(qd, kd, vd, scale, is_causal, group).double()
    emul_tc, lse_tc, lse_rounded = _tensor_core_emulation(q8, qs, k8, ks, vd, scale, is_causal, group)
    emul_tc = emul_tc.double()
    # (B, L, H, E) memory as models pass it.
    q8c, k8c, v8c = (t.transpose(1, 2).contiguous().transpose(1, 2).cuda() for t in (q8, k8, v8))
    out, lse = ops.fp8_fwd(q8c, k8c, v8c, qs.cuda(), ks.cuda(), vs.cuda(), scale, is_causal, True)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == (b, hq, lq, head_dim)
    out = out.cpu().double()
    assert out.isfinite().all() and ref_lse.isfinite().all()
    err, err_emul, err_tc = (_per_head_max(x - ref) for x in (out, emul, emul_tc))
    floor = _per_head_max(ref.to(torch.bfloat16).double() - ref)  # bf16 output rounding
    assert (err <= 2.5 * err_tc + 2 * floor + 1e-6).all(), (err / (err_tc + floor)).max()
    # Heads whose scaled scores stay within +-250: there the dot products'
    # rounding is small beside P's.
    logits = (scale * qd @ _expand(kd, group).transpose(-1, -2)).abs().flatten(2).amax(-1)
    moderate = logits <= 250
    assert moderate.float().mean() >= 0.5, logits
    within = err <= 2 * err_emul + 2 * floor + 1e-6
    assert within[moderate].all(), (err / (err_emul + floor))[moderate].max()
    # The logsumexp of the scores the tensor cores gave (of P as rounded for
    # P V where O's last column sums it).
    torch.testing.assert_close(lse.cpu(), lse_rounded if head_dim == 64 else lse_tc, rtol=2e-3, atol=1e-3)


@pytest.mark.gpu
def test_cuda_fp8_descales_zero_none_and_huge():
    """q's descale 0 gives uniform attention, v's 0 a zero output, none reads as 1,
    and a huge k descale a one-hot softmax, all finite and as the float64 reference."""
    _hopper()
    b, h, lq, lk, e = 1, 4, 200, 300, 128
    q, k, v = _inputs(b, h, h, lq, lk, e, seed=7, outliers=False)
    # Head 2: q row i is key i, of +-1 entries (every key's norm alike), so its
    # score leads the others' by far more than FP8's rounding of them.
    signs = torch.randint(0, 2, (lk, e), generator=torch.Generator().manual_seed(1)).float() * 2 - 1
    k[0, 2], q[0, 2] = signs, signs[:lq]
    (q8, qs), (k8, ks), (v8, vs) = _quantize(q, 1), _quantize(k, 1), _quantize(v, 1)
    qs[0, 0] = 0.0       # head 0: uniform attention
    vs[0, 1] = 0.0       # head 1: zero output
    ks[0, 2] = 1e30      # head 2: one-hot, on key i
    scale = e ** -0.5
    ref, _ = _float64_reference(_dequantize(q8, qs, 1), _dequantize(k8, ks, 1), _dequantize(v8, vs, 1), scale,
                                False, 1)
    out, lse = ops.fp8_fwd(q8.cuda(), k8.cuda(), v8.cuda(), qs.cuda(), ks.cuda(), vs.cuda(), scale)
    out = out.cpu().double()
    assert out.isfinite().all() and lse.isfinite().all()
    assert (out[0, 1] == 0).all()
    want_one_hot = _dequantize(v8, vs, 1)[0, 2, :lq]
    torch.testing.assert_close(out[0, 2], want_one_hot, rtol=1e-2, atol=0)
    # The edge heads (0-2) against the reference; head 3, descales as usual,
    # is the accuracy test's business.
    tol = 2e-2 * _per_head_max(ref)[0][:3, None, None]
    assert ((out - ref).abs()[0, :3] <= tol).all()
    # No descales: every factor 1.
    plain, _ = ops.fp8_fwd(q8.cuda(), k8.cuda(), v8.cuda(), None, None, None, scale)
    ones = torch.ones(b, h, device="cuda")
    torch.testing.assert_close(plain, ops.fp8_fwd(q8.cuda(), k8.cuda(), v8.cuda(), ones, ones, ones, scale)[0],
                               rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_fp8_nan_stays_in_its_head():
    """NaN (e4m3 0x7f) in one head's V reaches that head's output alone."""
    _hopper()
    q, k, v = _inputs(1, 4, 4, 130, 190, 128, seed=3, outliers=False)
    (q8, qs), (k8, ks), (v8, vs) = _quantize(q, 1), _quantize(k, 1), _quantize(v, 1)
    v8.view(torch.uint8)[0, 1, 5, 7] = 0x7F
    out, _ = ops.fp8_fwd(q8.cuda(), k8.cuda(), v8.cuda(), qs.cuda(), ks.cuda(), vs.cuda())
    out = out.cpu()
    assert out[0, 1].isnan().any()
    assert out[0, [0, 2, 3]].isfinite().all()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_cuda_fp8_nan_score_reaches_the_rows_that_see_it(head_dim, is_causal):
    """A NaN key (e4m3 0x7f) makes NaN exactly the rows that see it (the row max
    skips NaN, its exponential does not): each head's NaN key sits at another
    offset, so that it lands in several of a thread's column slots, and the
    rows before it under the causal mask stay finite."""
    _hopper()
    h, l = 8, 200
    q, k, v = _inputs(1, h, h, l, l, head_dim, seed=head_dim + 11, outliers=False)
    (q8, qs), (k8, ks), (v8, vs) = _quantize(q, 1), _quantize(k, 1), _quantize(v, 1)
    where = [3 + 13 * i for i in range(h)]  # key % 32: 3, 16, 29, 10, 23, 4, 17, 30
    for i, p in enumerate(where):
        k8.view(torch.uint8)[0, i, p] = 0x7F
    out, _ = ops.fp8_fwd(q8.cuda(), k8.cuda(), v8.cuda(), qs.cuda(), ks.cuda(), vs.cuda(), None, is_causal)
    out = out.cpu()
    for i, p in enumerate(where):
        first = p if is_causal else 0
        assert out[0, i, :first].isfinite().all(), (i, p)
        assert out[0, i, first:].isnan().all(), (i, p)


def _packed(lens_q, lens_k, h, e, seed):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = (torch.randn(int(cu_q[-1]), h, e, generator=g) * 50).to(FP8)
    k = (torch.randn(int(cu_k[-1]), h, e, generator=g) * 50).to(FP8)
    v = (torch.randn(int(cu_k[-1]), h, e, generator=g) * 50).to(FP8)
    return q, k, v, cu_q, cu_k


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_cuda_fp8_packed_matches_each_sequence_alone(head_dim, is_causal):
    """A packed batch (empty sequences, L != S, NaN in another sequence's keys
    next door) gives each sequence what the dense kernel gives it alone."""
    _hopper()
    lens_q, lens_k = [130, 0, 77, 300, 5], [200, 9, 0, 257, 700]
    h = 4
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, h, head_dim, seed=head_dim)
    # NaN in sequence 3's keys, read by no other sequence.
    k.view(torch.uint8)[int(cu_k[3]) + 1] = 0x7F
    v.view(torch.uint8)[int(cu_k[3]) + 2] = 0x7F
    ds = torch.rand(len(lens_q), h) + 0.01
    args = [t.cuda() for t in (q, k, v, cu_q, cu_k)]
    out, _ = ops.fp8_varlen_fwd(*args, max(lens_q), max(lens_k), ds.cuda(), ds.cuda(), ds.cuda(), None,
                                is_causal)
    out = out.cpu()
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lq == 0:
            continue
        if lk == 0:
            assert (out[rows] == 0).all()
            continue
        one = [t.unsqueeze(0).transpose(1, 2).cuda() for t in (q[rows], k[keys], v[keys])]
        d = ds[b:b + 1].cuda()
        alone, _ = ops.fp8_fwd(*one, d, d, d, None, is_causal, True)
        got = out[rows]
        if b == 3:
            continue  # its own NaN
        assert got.isfinite().all()
        torch.testing.assert_close(got, alone[0].transpose(0, 1).cpu(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_cuda_fp8_errors_name_the_argument():
    _hopper()
    q8 = torch.randn(1, 2, 64, 128, device="cuda").to(FP8)
    with pytest.raises(RuntimeError, match="q_descale"):
        ops.fp8_fwd(q8, q8, q8, torch.ones(2, 2, device="cuda"))
    with pytest.raises(RuntimeError, match="k_descale must be float32"):
        ops.fp8_fwd(q8, q8, q8, None, torch.ones(1, 2, device="cuda", dtype=torch.float16))
    q96 = torch.randn(1, 2, 64, 96, device="cuda").to(FP8)
    with pytest.raises(RuntimeError, match="head_dim 96"):
        ops.fp8_fwd(q96, q96, q96)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        ops.fp8_fwd(q8.bfloat16(), q8.bfloat16(), q8.bfloat16())
    odd = torch.randn(1, 2, 64, 136, device="cuda").to(FP8)[..., :128]  # rows 136 bytes apart
    with pytest.raises(RuntimeError, match="stride"):
        ops.fp8_fwd(odd, odd, odd)


def _quantized_sdpa():
    from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import (
        _scaled_dot_product_attention_quantized)
    return _scaled_dot_product_attention_quantized


def _sdpa_inputs(b=2, hq=8, hkv=2, lq=300, lk=300, e=128):
    # As models pass them: (B, L, H, E) memory seen as (B, H, L, E).
    q = torch.randn(b, lq, hq, e, device="cuda").to(FP8).transpose(1, 2)
    k = torch.randn(b, lk, hkv, e, device="cuda").to(FP8).transpose(1, 2)
    v = torch.randn(b, lk, hkv, e, device="cuda").to(FP8).transpose(1, 2)
    ds = [torch.rand(b, hkv, device="cuda") + 0.5 for _ in range(3)]
    return q, k, v, ds


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_cuda_quantized_sdpa_served_by_the_provider_and_enable(is_causal):
    _hopper()
    sdpa_q = _quantized_sdpa()
    q, k, v, (qd, kd, vd) = _sdpa_inputs()
    want, _ = ops.fp8_fwd(q, k, v, qd, kd, vd, None, is_causal, True)
    tfb.reset_stats()
    activate_flash_attention_impl("torch_flash_backend")
    try:
        got = sdpa_q(q, k, v, is_causal=is_causal, q_descale=qd, k_descale=kd, v_descale=vd)
    finally:
        restore_flash_attention_impl()
    assert got.dtype == torch.bfloat16 and got.stride() == q.stride()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert tfb.stats()["routed"] == {"sm90_fwd_fp8_hdim128": 1}
    with tfb.enable():
        got = sdpa_q(q, k, v, is_causal=is_causal, q_descale=qd, k_descale=kd, v_descale=vd)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert tfb.stats()["routed"] == {"sm90_fwd_fp8_hdim128": 2}
    assert str(tfb.explain(q, k, v, is_causal=is_causal)).startswith("served by sm90_fwd_fp8_hdim128")


@pytest.mark.gpu
def test_cuda_quantized_varlen_served_by_the_provider():
    """_flash_attention_forward.quantized with cum_seq_q / cum_seq_k."""
    _hopper()
    q, k, v, cu_q, cu_k = (t.cuda() for t in _packed([100, 33, 250], [120, 64, 250], 4, 128, seed=1))
    ds = torch.rand(3, 4, device="cuda") + 0.5
    want, want_lse = ops.fp8_varlen_fwd(q, k, v, cu_q, cu_k, 250, 250, ds, ds, ds, None, True)
    activate_flash_attention_impl("torch_flash_backend")
    try:
        out, lse, *_ = torch.ops.aten._flash_attention_forward.quantized(
            q, k, v, cu_q, cu_k, 250, 250, 0.0, True, False, ds, ds, ds)
    finally:
        restore_flash_attention_impl()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_quantized_sdpa_refuses_gradients_as_pytorch_does():
    """PyTorch's warning, then no gradient: backward raises, never a wrong one."""
    _hopper()
    q, k, v, (qd, kd, vd) = _sdpa_inputs(lq=64, lk=64)
    q = q.detach().requires_grad_()
    activate_flash_attention_impl("torch_flash_backend")
    try:
        with pytest.warns(UserWarning, match="does not support backward"):
            out = _quantized_sdpa()(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    finally:
        restore_flash_attention_impl()
    with pytest.raises(RuntimeError):
        out.float().sum().backward()
    assert q.grad is None


@pytest.mark.gpu
def test_cuda_quantized_sdpa_compiles_fullgraph():
    _hopper()
    sdpa_q = _quantized_sdpa()
    q, k, v, (qd, kd, vd) = _sdpa_inputs(lq=256, lk=384)

    def f(q, k, v, qd, kd, vd):
        return sdpa_q(q, k, v, is_causal=True, q_descale=qd, k_descale=kd, v_descale=vd) * 2

    activate_flash_attention_impl("torch_flash_backend")
    try:
        eager = f(q, k, v, qd, kd, vd)
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(f, fullgraph=True)(q, k, v, qd, kd, vd)
    finally:
        restore_flash_attention_impl()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_fp8_opcheck():
    _hopper()
    q, k, v, (qd, kd, vd) = _sdpa_inputs(b=1, hq=4, hkv=2, lq=70, lk=90)
    # test_schema compares the inputs before and after with arithmetic float8 lacks.
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.fp8_fwd, (q, k, v, qd[:1], kd[:1], vd[:1], None, True, True), test_utils=checks)
    pq, pk, pv, cu_q, cu_k = (t.cuda() for t in _packed([30, 0, 41], [50, 7, 41], 2, 64, seed=5))
    ds = torch.rand(3, 2, device="cuda") + 0.5
    torch.library.opcheck(ops.fp8_varlen_fwd, (pq, pk, pv, cu_q, cu_k, 41, 50, ds, ds, ds, None, False, None),
                          test_utils=checks)
