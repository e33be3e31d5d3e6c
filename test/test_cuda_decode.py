"""The decode family (split-KV forward for short queries) against the float64 reference.

Short queries (L <= 16) against caches of any length, GQA ratios, causal (top-left,
as SDPA), the cache layouts Hugging Face passes ((B, Hkv, S, E) contiguous) and
the transposed one, odd lengths, one split and many. The output's error must stay
within 2x PyTorch's own SDPA's in the same dtype (plus a 1e-5 floor); lse within
a fixed tolerance. Outputs land in memory filled with NaN just before (the
caching allocator hands the freed block back), so an element the kernels do not
write fails the check.
"""
import pytest
import torch
import torch.nn.functional as F

import torch_flash_backend as tfb
from torch_flash_backend import testing

from reference import assert_within_baseline, attention_ref, max_err

pytestmark = pytest.mark.gpu

ops = torch.ops.torch_flash_backend
LSE_TOL = 1e-3
DTYPES = (torch.float16, torch.bfloat16)


def require(dtype, e):
    name = f"decode_fwd_{'fp16' if dtype == torch.float16 else 'bf16'}_hdim{e}"
    if name not in tfb.built_kernels():
        pytest.skip(f"{name} not built")


def make_q(b, hq, length, e, dtype):
    """(B, L, Hq, E).transpose(1, 2), as a model's projection gives it."""
    return torch.randn(b, length, hq, e, device="cuda", dtype=dtype).transpose(1, 2)


def make_kv(b, hkv, s, e, dtype, layout):
    if layout == "cache":  # (B, Hkv, S, E) contiguous, Hugging Face's cache
        return torch.randn(b, hkv, s, e, device="cuda", dtype=dtype)
    if layout == "blhe":  # (B, S, Hkv, E).transpose(1, 2)
        return torch.randn(b, s, hkv, e, device="cuda", dtype=dtype).transpose(1, 2)
    # a cache preallocated longer than its use, read up to s
    return torch.randn(b, hkv, s + 40, e, device="cuda", dtype=dtype)[:, :, :s]


def poisoned_fwd(q, k, v, scale=None, causal=False):
    b, hq, length, e = q.shape
    torch.empty(b * hq * length * e * 2 + 4096, device="cuda", dtype=q.dtype).fill_(float("nan"))
    return ops.fwd(q, k, v, scale, causal, "decode")


def check(b, hq, hkv, length, s, e, dtype, causal, layout, scale=None):
    q = make_q(b, hq, length, e, dtype)
    k, v = make_kv(b, hkv, s, e, dtype, layout), make_kv(b, hkv, s, e, dtype, layout)
    out, lse = poisoned_fwd(q, k, v, scale, causal)
    torch.cuda.synchronize()
    name = f"b{b} h{hq}:{hkv} L{length} S{s} E{e} {dtype} causal={causal} {layout}"
    ref_out, ref_lse = attention_ref(q, k, v, scale, causal)
    baseline = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=hq != hkv)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert_within_baseline(name, out, baseline, ref_out)
    assert max_err(lse, ref_lse) <= LSE_TOL, f"{name}: lse error {max_err(lse, ref_lse):.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("e", (32, 64, 96, 128, 192, 256))
@pytest.mark.parametrize("group,length", [(1, 1), (4, 1), (8, 1), (16, 1), (4, 4), (1, 16), (2, 3),
                                          (4, 16), (8, 3), (32, 1), (16, 16)])
def test_shapes(dtype, e, group, length):
    require(dtype, e)
    torch.manual_seed(e + 7 * group + length)
    for s, causal, layout in ((1, False, "cache"), (7, True, "blhe"), (129, False, "padded"), (1000, False, "cache"),
                              (1000, True, "cache"), (4097, False, "blhe")):
        check(2, 2 * group, 2, length, s, e, dtype, causal, layout)


@pytest.mark.parametrize("s", [1, 17, 127, 128, 129, 255, 16384, 100_000])
def test_cache_lengths(s):
    """One split and many, tiles cut at every edge, a 100K cache."""
    require(torch.bfloat16, 128)
    torch.manual_seed(s)
    check(3, 32, 8, 1, s, 128, torch.bfloat16, False, "cache")
    check(1, 8, 8, 2, s, 128, torch.bfloat16, False, "blhe", scale=0.3)


def test_batches_and_heads():
    """Batch 64 (the grid's z) and one kv head with 16 query heads."""
    require(torch.float16, 64)
    torch.manual_seed(1)
    check(64, 32, 8, 1, 300, 64, torch.float16, False, "cache")
    check(1, 16, 1, 1, 5000, 64, torch.float16, False, "cache")


def test_extreme_values():
    """Scores near the float range's edge stay finite where the reference is."""
    require(torch.bfloat16, 64)
    torch.manual_seed(2)
    q = make_q(1, 4, 1, 64, torch.bfloat16) * 30
    k = make_kv(1, 4, 2000, 64, torch.bfloat16, "cache") * 30
    v = make_kv(1, 4, 2000, 64, torch.bfloat16, "cache")
    out, lse = poisoned_fwd(q, k, v)
    ref_out, ref_lse = attention_ref(q, k, v)
    baseline = F.scaled_dot_product_attention(q, k, v)
    assert_within_baseline("large scores", out, baseline, ref_out)
    assert torch.isfinite(lse).all() and max_err(lse, ref_lse) <= 0.05


def test_nan_key_gives_nan_in_the_rows_that_see_it():
    """A NaN in K makes NaN exactly the rows whose visible keys include it: the
    softmax of a NaN score is NaN (PyTorch's fused kernels return numbers there,
    and test/reference.py zeroes rows without a finite score)."""
    require(torch.bfloat16, 64)
    q = make_q(1, 8, 1, 64, torch.bfloat16)
    k, v = (make_kv(1, 4, 300, 64, torch.bfloat16, "cache") for _ in range(2))
    k[0, 1, 17, 3] = float("nan")
    out, lse = poisoned_fwd(q, k, v)
    got = out.isnan().any(-1).flatten().tolist()
    assert got == [False, False, True, True, False, False, False, False], (got, lse.flatten().tolist())
    assert out[:, 2:4].isnan().all() and lse[:, 2:4].isnan().all()
    assert torch.isfinite(out[:, [0, 1, 4, 5, 6, 7]]).all()


def test_deterministic():
    require(torch.bfloat16, 128)
    torch.manual_seed(3)
    q = make_q(4, 32, 1, 128, torch.bfloat16)
    k, v = (make_kv(4, 8, 20000, 128, torch.bfloat16, "cache") for _ in range(2))
    first = ops.fwd(q, k, v, None, False, "decode")
    second = ops.fwd(q, k, v, None, False, "decode")
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_enable_serves_single_tokens_at_head_dim_256():
    """enable() (route_single_tokens off) serves a one-token step at head dim 256
    against 32 MiB of K and V or more, where the decode kernel is the faster,
    and leaves a smaller cache to PyTorch's SDPA."""
    require(torch.bfloat16, 256)
    q = make_q(1, 32, 1, 256, torch.bfloat16)
    k, v = (make_kv(1, 8, 4096, 256, torch.bfloat16, "cache") for _ in range(2))
    assert tfb.explain(q, k, v, enable_gqa=True).kernel == "decode_fwd_bf16_hdim256"

    def step():
        with tfb.enable():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert testing.launched_families(step) == {"decode"}
    assert_within_baseline("enable() E 256", step(), F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                           attention_ref(q, k, v)[0])
    assert not tfb.explain(q, k[:, :, :1024], v[:, :, :1024], enable_gqa=True).served


@pytest.fixture
def routed_short(monkeypatch):
    """enable() routing one-token queries to the decode family too (off by
    default: PyTorch's SDPA is faster there)."""
    from torch_flash_backend import _router
    monkeypatch.setattr(_router.probe, "route_single_tokens", True)


def test_enable_serves_decode_steps(routed_short):
    """Under enable() a one-token step runs the decode family, with the backward by sm80."""
    require(torch.bfloat16, 128)
    q = make_q(2, 32, 1, 128, torch.bfloat16)
    k, v = (make_kv(2, 8, 1024, 128, torch.bfloat16, "cache") for _ in range(2))
    decision = tfb.explain(q, k, v, enable_gqa=True)
    assert decision.kernel == "decode_fwd_bf16_hdim128", str(decision)

    def step():
        with tfb.enable(strict=True):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert testing.launched_families(step) == {"decode"}
    qg = q.detach().requires_grad_()
    d = tfb.explain(qg, k, v, enable_gqa=True)
    hopper = torch.cuda.get_device_capability() == (9, 0) and "sm90_bwd_bf16_hdim128" in tfb.built_kernels()
    backward = "sm90_bwd_bf16_hdim128" if hopper else "sm80_bwd_bf16_hdim128"
    assert (d.kernel, d.backward_kernel) == ("decode_fwd_bf16_hdim128", backward), str(d)
    with tfb.enable(strict=True):
        out = F.scaled_dot_product_attention(qg, k, v, enable_gqa=True)
    (grad,) = torch.autograd.grad(out.float().square().sum(), qg)
    q64 = q.detach().double().requires_grad_()
    ref, _ = attention_ref(q64, k, v)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), q64)
    assert max_err(grad, ref_grad) <= 0.05 * ref_grad.abs().max().item()


def test_strict_serves_single_tokens():
    """enable() leaves one query token to PyTorch's SDPA (faster there), but
    enable(strict=True) means our kernels or an error: it runs the decode
    family, and explain(strict=True) says so."""
    require(torch.bfloat16, 128)
    q = make_q(2, 32, 1, 128, torch.bfloat16)
    k, v = (make_kv(2, 8, 1000, 128, torch.bfloat16, "cache") for _ in range(2))
    assert not tfb.explain(q, k, v, enable_gqa=True).served
    assert tfb.explain(q, k, v, enable_gqa=True, strict=True).kernel == "decode_fwd_bf16_hdim128"

    def step(strict):
        with tfb.enable(strict=strict):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert testing.launched_families(lambda: step(False)) == set()
    for _ in range(2):  # the second call through the routing cache
        assert testing.launched_families(lambda: step(True)) == {"decode"}
    assert testing.launched_families(lambda: step(False)) == set()  # strict's choice stays strict's
    ref, _ = attention_ref(q.double(), k.double(), v.double())
    assert max_err(step(True), ref) <= 2e-2


@pytest.mark.parametrize("length", [2, 4, 16])
def test_enable_serves_speculative_blocks_by_default(length):
    """By default enable() sends 2-16 query tokens (speculative decoding blocks)
    to the decode family, causal as SDPA's top-left rule, and keeps one token
    for PyTorch's SDPA."""
    require(torch.bfloat16, 128)
    q = make_q(2, 32, length, 128, torch.bfloat16)
    k, v = (make_kv(2, 8, 777, 128, torch.bfloat16, "cache") for _ in range(2))

    def step():
        with tfb.enable(strict=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert testing.launched_families(step) == {"decode"}
    ref, _ = attention_ref(q.double(), k.double(), v.double(), is_causal=True)
    assert max_err(step(), ref) <= 2e-2
    assert not tfb.explain(q[:, :, :1], k, v, enable_gqa=True).served


def test_cuda_graph_replay_equals_eager(routed_short):
    """A decode step captured in a CUDA graph (as generation loops are) replays like eager."""
    require(torch.bfloat16, 128)
    torch.manual_seed(5)
    q = make_q(8, 32, 1, 128, torch.bfloat16)
    k, v = (make_kv(8, 8, 4096, 128, torch.bfloat16, "cache") for _ in range(2))

    def step():
        with tfb.enable(strict=True):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    q.copy_(make_q(8, 32, 1, 128, torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())
    assert not torch.equal(captured, eager)


# ------------------------------------------------------------------ attn_mask


def make_mask(kind, b, hq, length, s, generator=None):
    """Boolean masks (True = take part) as callers pass them."""
    g = torch.Generator().manual_seed(b * 7919 + hq * 31 + length * 17 + s)
    if kind == "random":  # per head, about half visible
        return (torch.rand(b, hq, length, s, generator=g) > 0.5).cuda()
    if kind == "2d":  # (L, S), broadcast over batch and heads
        return (torch.rand(length, s, generator=g) > 0.3).cuda()
    if kind == "cache":  # a static cache in use up to a length per batch row, causal within the block
        used = torch.randint(length, s + 1, (b,), generator=g)
        used[0] = s
        keys, rows = torch.arange(s), torch.arange(length)
        visible = keys[None, None, :] <= (used[:, None, None] - length + rows[None, :, None])
        return visible[:, None].cuda()  # (B, 1, L, S)
    if kind == "transposed":  # keys not contiguous: (B, H, S, L) seen as (B, H, L, S)
        return (torch.rand(b, hq, s, length, generator=g) > 0.5).cuda().transpose(-1, -2)
    if kind == "blocks":  # whole 16-key tiles hidden or shown, some tiles in part
        tiles = (torch.rand(b, 1, length, (s + 15) // 16, generator=g) > 0.6).repeat_interleave(16, -1)[..., :s]
        tiles[..., 5::37] = ~tiles[..., 5::37]
        return tiles.cuda()
    if kind == "empty_rows":  # random, with rows of every head that see nothing
        mask = torch.rand(b, hq, length, s, generator=g) > 0.5
        mask[:, ::3, length // 2] = False
        mask[-1] = False
        return mask.cuda()
    raise ValueError(kind)


def check_masked(b, hq, hkv, length, s, e, dtype, kind, layout="cache"):
    q = make_q(b, hq, length, e, dtype)
    k, v = make_kv(b, hkv, s, e, dtype, layout), make_kv(b, hkv, s, e, dtype, layout)
    mask = make_mask(kind, b, hq, length, s)
    torch.empty(b * hq * length * e * 2 + 4096, device="cuda", dtype=dtype).fill_(float("nan"))
    out, lse = ops.fwd(q, k, v, None, False, "decode", attn_mask=mask)
    torch.cuda.synchronize()
    name = f"b{b} h{hq}:{hkv} L{length} S{s} E{e} {dtype} mask={kind} {layout}"
    ref_out, ref_lse = attention_ref(q, k, v, attn_mask=mask)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        baseline = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)
    assert_within_baseline(name, out, baseline.nan_to_num(0.0), ref_out)
    empty = torch.isneginf(ref_lse)
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all(), f"{name}: rows that see no key"
    assert max_err(lse[~empty], ref_lse[~empty]) <= LSE_TOL, f"{name}: lse error"
    return q, k, v, mask, out


@pytest.mark.parametrize("kind", ["random", "2d", "cache", "transposed", "blocks", "empty_rows"])
@pytest.mark.parametrize("group,length", [(1, 1), (4, 1), (8, 1), (4, 4), (1, 16), (2, 3), (16, 16)])
def test_masks(kind, group, length):
    require(torch.bfloat16, 128)
    torch.manual_seed(group * 100 + length)
    check_masked(2, 2 * group, 2, length, 1000, 128, torch.bfloat16, kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("e", (32, 64, 96, 128, 192, 256))
def test_masks_every_head_dim(dtype, e):
    require(dtype, e)
    torch.manual_seed(e)
    check_masked(2, 8, 2, 2, 777, e, dtype, "random", "blhe")
    check_masked(3, 4, 4, 1, 333, e, dtype, "cache", "tail")


@pytest.mark.parametrize("s", [1, 17, 129, 16384, 40_000, 100_000])
def test_masked_cache_lengths(s):
    """Short caches (one tile), many splits, and splits past the tile list's
    32K keys (more splits then)."""
    require(torch.float16, 128)
    torch.manual_seed(s)
    check_masked(1, 8, 1, 1, s, 128, torch.float16, "cache")
    check_masked(2, 4, 2, 3, s, 128, torch.float16, "blocks")


def test_fully_masked_rows_as_pytorch_math():
    """Rows the mask hides entirely give 0, as PyTorch's math and efficient
    backends give (its cuDNN backend, the default on Hopper, gives such a row
    the unmasked attention instead)."""
    require(torch.bfloat16, 128)
    q, k, v, mask, out = check_masked(2, 8, 8, 4, 500, 128, torch.bfloat16, "empty_rows")
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        math = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    empty = ~mask.any(-1)
    assert empty.any()
    assert torch.equal(out[empty], math[empty]), (out[empty].unique(), math[empty].unique())


@pytest.mark.parametrize("length", [1, 4])
def test_enable_serves_masked_steps(routed_short, length):
    """enable() sends a masked short query to the decode family (a single token
    when route_single_tokens is on, as for unmasked ones), with grad its
    backward to a tiled family (sm90 on Hopper, which reads a boolean mask,
    else sm80), a longer query to a tiled family, and falls back, with the
    reason, where the mask cannot be read."""
    require(torch.bfloat16, 128)
    q = make_q(2, 32, length, 128, torch.bfloat16)
    k, v = (make_kv(2, 8, 1024, 128, torch.bfloat16, "cache") for _ in range(2))
    mask = make_mask("cache", 2, 32, length, 1024)
    decision = tfb.explain(q, k, v, attn_mask=mask, enable_gqa=True)
    assert decision.kernel == "decode_fwd_bf16_hdim128" and "attn_mask" in str(decision), str(decision)

    def step():
        with tfb.enable(strict=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert testing.launched_families(step) == {"decode"}
    ref, _ = attention_ref(q.double(), k.double(), v.double(), attn_mask=mask)
    assert max_err(step(), ref) <= 2e-2
    grad = tfb.explain(q.detach().requires_grad_(), k, v, attn_mask=mask, enable_gqa=True)
    hopper = torch.cuda.get_device_capability() == (9, 0) and "sm90_bwd_bf16_hdim128" in tfb.built_kernels()
    backward = "sm90_bwd_bf16_hdim128" if hopper else "sm80_bwd_bf16_hdim128"
    assert (grad.kernel, grad.backward_kernel) == ("decode_fwd_bf16_hdim128", backward), str(grad)
    long = tfb.explain(make_q(2, 32, 17, 128, torch.bfloat16), k, v, attn_mask=mask[:, :, :1], enable_gqa=True)
    assert long.served and long.family in ("sm80", "sm90"), str(long)
    additive = tfb.explain(q, k, v, attn_mask=torch.zeros(1024, device="cuda"), enable_gqa=True)
    assert additive.kernel == "decode_fwd_bf16_hdim128" and "additive attn_mask (fp32)" in additive.reason


def test_masked_cuda_graph_replay_equals_eager(routed_short):
    """A masked step captured in a CUDA graph replays like eager, the mask's
    contents read at replay (a static cache's mask changes every step)."""
    require(torch.bfloat16, 128)
    torch.manual_seed(6)
    q = make_q(8, 32, 1, 128, torch.bfloat16)
    k, v = (make_kv(8, 8, 4096, 128, torch.bfloat16, "cache") for _ in range(2))
    mask = make_mask("cache", 8, 32, 1, 4096)

    def step():
        with tfb.enable(strict=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    mask.copy_(make_mask("cache", 8, 32, 1, 4096).roll(1000, -1))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())
    ref, _ = attention_ref(q.double(), k.double(), v.double(), attn_mask=mask)
    assert max_err(captured, ref) <= 2e-2


def test_explain_states_the_share_of_key_tiles_a_mask_hides():
    """For a masked call the decode family serves, explain() reads the mask and
    says which share of its key tiles no row sees: a static cache in use up to
    300 of 1024 keys hides 45 of 64 tiles at each kv head."""
    require(torch.bfloat16, 128)
    q = make_q(2, 32, 4, 128, torch.bfloat16)
    k, v = (make_kv(2, 8, 1024, 128, torch.bfloat16, "cache") for _ in range(2))
    mask = (torch.arange(1024, device="cuda") < 300).expand(2, 1, 4, 1024)
    d = tfb.explain(q, k, v, attn_mask=mask, enable_gqa=True)
    assert d.kernel == "decode_fwd_bf16_hdim128", str(d)
    assert d.tiles_skipped == pytest.approx(1 - 19 / 64) and "hides 70% of its tiles" in str(d), str(d)
    assert tfb.explain(q, k, v, enable_gqa=True).tiles_skipped is None
