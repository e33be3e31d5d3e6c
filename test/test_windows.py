"""Sliding windows as a band (the ops' window_left / window_right, PyTorch's
flash ops' window_size): the kernels read the band's edges, never a mask in
memory, and visit only the key tiles inside it. Each window must give what the
same window given as a boolean attn_mask gives: against the float64 reference
(2x PyTorch's own error rule), forward and backward, both alignments, odd
lengths, L != S, GQA, rows that see no key; the CPU ops too. Through the
provider hook a window is served, and the result matches PyTorch's own flash
kernel's.
"""
import pytest
import torch

import torch_flash_backend as tfb
from torch_flash_backend import _provider, testing

from reference import assert_within_baseline, attention_ref, max_err, stable_seed

ops = torch.ops.torch_flash_backend

# (window_left, window_right, is_causal): -1 opens a side; is_causal closes the right side at the diagonal.
WINDOWS = [(0, 0, False), (1, 0, False), (16, 0, False), (100, 0, False), (300, -1, True), (5, 7, False),
           (-1, 3, False), (64, -1, False), (130, 130, False), (2000, 0, False)]


def band_mask(length, s, left, right, is_causal, bottom_right, device):
    """The window as a boolean (1, 1, L, S) mask: row i sees keys
    i + d - left <= j <= i + d + right, d = S - L with bottom_right else 0."""
    rows = torch.arange(length, device=device)[:, None]
    keys = torch.arange(s, device=device)[None, :]
    diag = rows + (s - length if bottom_right else 0)
    if is_causal:
        right = 0
    visible = torch.ones(length, s, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= keys >= diag - left
    if right >= 0:
        visible &= keys <= diag + right
    return visible[None, None]


def make(b, h, n, e, dtype, device):
    return torch.randn(b, n, h, e, device=device, dtype=dtype).transpose(1, 2)  # a model's (B, L, H, E) view


def poison(q, copies=4):
    # Outputs are allocated right after: memory the allocator hands back holds NaN.
    junk = [torch.full_like(q, float("nan")) for _ in range(copies)]
    del junk


def check_window(b, hq, hkv, length, s, e, dtype, window, bottom_right, family, device="cuda", grads=True):
    left, right, is_causal = window
    q, k, v, dout = (make(b, h, n, e, dtype, device) for h, n in ((hq, length), (hkv, s), (hkv, s), (hq, length)))
    mask = band_mask(length, s, left, right, is_causal, bottom_right, device)
    name = f"{family} b{b} h{hq}:{hkv} L{length} S{s} E{e} {dtype} window={window} bottom_right={bottom_right}"
    band = dict(bottom_right=bottom_right, window_left=left, window_right=right)
    poison(q)
    out, lse = ops.fwd(q, k, v, None, is_causal, family, **band)
    out_m, _ = ops.fwd(q, k, v, None, False, family, attn_mask=mask)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = attention_ref(q64, k64, v64, attn_mask=mask)
    # The same window as a mask in memory: the baseline the band must match.
    assert_within_baseline(f"{name}: out", out, out_m, ref_out.detach(), floor=1e-4)
    empty = torch.isneginf(ref_lse.detach())
    assert (out[empty] == 0).all() and torch.isinf(lse[empty]).all(), f"{name}: rows that see no key"
    assert max_err(lse[~empty], ref_lse.detach()[~empty]) <= 1e-3, f"{name}: lse"
    if not grads:
        return
    ref = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())
    ref_o, ref_l = ref_out.detach().to(dtype), ref_lse.detach().float().contiguous()
    poison(q, copies=6)
    ours = ops.bwd(dout, q, k, v, ref_o, ref_l, None, is_causal, family, **band)
    masked = ops.bwd(dout, q, k, v, ref_o, ref_l, None, False, family, attn_mask=mask)
    for what, o, m, r in zip(("dq", "dk", "dv"), ours, masked, ref):
        assert_within_baseline(f"{name}: {what}", o, m, r, floor=1e-4)
    assert (ours[0][empty] == 0).all(), f"{name}: dq of rows that see no key"


SHAPES = [(1, 2, 2, 129, 250), (2, 4, 2, 300, 300), (1, 2, 1, 257, 130), (2, 2, 2, 1000, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("bottom_right", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_window_matches_its_mask(window, bottom_right, family):
    dn = "bf16"
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 runs on compute capability 9.0 alone")
    if f"{family}_bwd_{dn}_hdim128" not in tfb.built_kernels():
        pytest.skip(f"{family} head dim 128 not built")
    with testing.kernel_families():
        for shape in SHAPES:
            torch.manual_seed(stable_seed(window, bottom_right, shape))
            check_window(*shape, 128, torch.bfloat16, window, bottom_right, family)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("e", [32, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_window_every_head_dim(dtype, e, family):
    dn = "fp16" if dtype == torch.float16 else "bf16"
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 runs on compute capability 9.0 alone")
    if f"{family}_bwd_{dn}_hdim{e}" not in tfb.built_kernels():
        pytest.skip(f"{family} head dim {e} not built")
    torch.manual_seed(e)
    with testing.kernel_families():
        check_window(2, 4, 2, 333, 517, e, dtype, (70, 0, False), True, family)
        check_window(1, 2, 1, 200, 200, e, dtype, (33, 9, False), False, family)


@pytest.mark.parametrize("window", WINDOWS[:6], ids=str)
def test_cpu_ops_read_the_band(window):
    """The CPU ops take the band from the same rule (src/common/mask.h band_of)."""
    torch.manual_seed(stable_seed("cpu", window))
    for shape in ((1, 2, 1, 37, 70), (1, 2, 2, 70, 37)):
        check_window(*shape, 32, torch.float32, window, True, "cpu", device="cpu")


def test_bad_windows_raise_naming_the_argument():
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(Exception, match="window_left"):
        ops.fwd(q, q, q, window_left=-2)
    with pytest.raises(Exception, match="window_right"):
        ops.fwd(q, q, q, window_right=-5)
    with pytest.raises(Exception, match="attn_mask cannot be combined"):
        ops.fwd(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool), window_left=3)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():  # the fake kernels say the same while tracing
        fq = torch.empty(1, 1, 8, 16)
        with pytest.raises(ValueError, match="window_left"):
            ops.fwd(fq, fq, fq, window_left=-2)
    # The router reads the same rule (the provider hands it PyTorch's window_size).
    from torch_flash_backend import _router
    with FakeTensorMode(), testing.pretend_cuda():
        cq = torch.empty(1, 1, 64, 64, dtype=torch.bfloat16, device="cuda")
        assert _router.decide(cq, cq, cq, window=(16, 0)).served
        with pytest.raises(ValueError, match="window_right"):
            _router.decide(cq, cq, cq, window=(16, -3))
        with pytest.raises(ValueError, match="attn_mask cannot be combined"):
            _router.decide(cq, cq, cq, torch.ones(64, 64, dtype=torch.bool, device="cuda"), window=(16, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(16, 0), (40, 40), (-1, 8), (100, -1)], ids=str)
@pytest.mark.parametrize("grad", [False, True])
def test_provider_serves_windows(window, grad):
    """PyTorch's flash op with window_size_left / right through the provider
    hook: served by our kernels (stats() says so), the result within 2x of
    PyTorch's own flash kernel's error."""
    dn = "bf16"
    if f"sm80_fwd_{dn}_hdim64" not in tfb.built_kernels():
        pytest.skip("head dim 64 not built")
    original = {name: torch.library.get_kernel(f"aten::{name}", "CUDA") for name in _provider._OPS}
    ours = _provider._make_kernels(original)
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    torch.manual_seed(stable_seed("provider", window, grad))
    b, h, length, e = 2, 4, 300, 64
    q, k, v, dout = (torch.randn(b, length, h, e, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    args = (None, None, length, length, 0.0, False, False)
    kw = dict(scale=None, window_size_left=window[0], window_size_right=window[1])
    tfb.reset_stats()
    out, lse, rng, unused, _ = ours["_flash_attention_forward"](keyset, q, k, v, *args, **kw)
    theirs, their_lse, their_rng, their_unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, *args, **kw)
    mask = band_mask(length, length, window[0], window[1], False, True, "cuda")
    ref, _ = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    assert_within_baseline(f"provider window={window}", out.transpose(1, 2), theirs.transpose(1, 2), ref, floor=1e-4)
    routed = tfb.stats()["routed"]
    assert routed and not tfb.stats()["fallback"], tfb.stats()
    if grad:
        bwd_args = (None, None, length, length, 0.0, False)
        grads = ours["_flash_attention_backward"](keyset, dout, q, k, v, out, lse, *bwd_args, rng, unused, **kw)
        their_grads = torch.ops.aten._flash_attention_backward(dout, q, k, v, theirs, their_lse, *bwd_args,
                                                              their_rng, their_unused, **kw)
        q64, k64, v64 = (t.transpose(1, 2).double().requires_grad_() for t in (q, k, v))
        ref_out, _ = attention_ref(q64, k64, v64, attn_mask=mask)
        ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), dout.transpose(1, 2).double())
        for what, o, t, r in zip(("dq", "dk", "dv"), grads, their_grads, ref_grads):
            assert_within_baseline(f"provider window={window} {what}", o.transpose(1, 2), t.transpose(1, 2), r,
                                   floor=1e-4)
