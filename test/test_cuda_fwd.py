"""The forward kernels of every family the GPU runs against the float64 reference.

Each test runs once per family (sm80 everywhere, sm90 on compute capability 9.0
when built), pinned with testing.kernel_families, so one grid covers both. The
output's error must stay within 2x the error of PyTorch's own SDPA in the same
dtype (plus a 1e-5 floor); lse is float32 throughout, so it gets a fixed
tolerance. Kernels left out of the build are skipped.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import torch_flash_backend as tfb
from torch_flash_backend import _router, testing

from reference import assert_within_baseline, attention_ref, max_err

pytestmark = pytest.mark.gpu

FAMILIES = ("sm80", "sm90")  # the registry's CUDA families (src/registry.py)
HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
DTYPES = (torch.float16, torch.bfloat16)
LENGTHS = (1, 17, 127, 128, 129, 1000)
LSE_TOL = 1e-3


@pytest.fixture(autouse=True)
def all_families():
    """Every family unless a test pins some, whatever TFB_KERNEL_FAMILIES says outside."""
    with testing.kernel_families():
        yield


@pytest.fixture(params=FAMILIES)
def family(request):
    with testing.kernel_families(request.param):
        yield request.param


def fwd(q, k, v, scale=None, is_causal=False):
    """The forward op running the family the pinned families choose."""
    family, _ = _router.pinned_families(q, k, v, enable_gqa=q.size(1) != k.size(1), needs_grad=False)
    return torch.ops.torch_flash_backend.fwd(q, k, v, scale, is_causal, family)


def kernel_name(family, dtype, head_dim):
    return f"{family}_fwd_{'fp16' if dtype == torch.float16 else 'bf16'}_hdim{head_dim}"


def require_kernel(family, dtype, head_dim):
    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 kernels run on compute capability 9.0 only")
    name = kernel_name(family, dtype, head_dim)
    if name not in tfb.built_kernels():
        pytest.skip(f"{name} not built")


def randn(batch, heads, length, head_dim, dtype, layout):
    """(B, H, L, E) contiguous, or the (B, L, H, E).transpose(1, 2) view."""
    if layout == "bhle":
        return torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
    return torch.randn(batch, length, heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)


def check_out(name, q, k, v, out, lse, scale=None, causal=False):
    ref_out, ref_lse = attention_ref(q, k, v, scale, causal)
    baseline = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_within_baseline(name, out, baseline, ref_out)
    assert lse.shape == ref_lse.shape
    assert max_err(lse, ref_lse) <= LSE_TOL, f"{name}: lse error {max_err(lse, ref_lse):.3e}"


def check(batch, heads_q, heads_kv, len_q, len_k, head_dim, dtype, causal, layout, scale=None):
    q = randn(batch, heads_q, len_q, head_dim, dtype, layout)
    k = randn(batch, heads_kv, len_k, head_dim, dtype, layout)
    v = randn(batch, heads_kv, len_k, head_dim, dtype, layout)
    out, lse = fwd(q, k, v, scale, causal)
    torch.cuda.synchronize()
    name = f"B={batch} H={heads_q}/{heads_kv} L={len_q} S={len_k} E={head_dim} {dtype} causal={causal} {layout}"
    check_out(name, q, k, v, out, lse, scale, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_lengths(family, head_dim, dtype, causal):
    """Every pair of odd and tile-edge lengths, L < S, L == S and L > S."""
    require_kernel(family, dtype, head_dim)
    torch.manual_seed(head_dim)
    for len_q in LENGTHS:
        for len_k in LENGTHS:
            layout = "bhle" if (len_q + len_k) % 2 else "blhe"
            check(1, 2, 2, len_q, len_k, head_dim, dtype, causal, layout)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_causal_tile_walk(family, head_dim):
    """Causal lengths on both sides of the sm90 tile switches (head dim 64: 128- to
    192-row tiles above 2048 queries; 256: 64- to 80-key tiles above 1024), with odd
    and even query-tile counts (the scheduler pairs tile M-1-i with tile i; an odd M
    leaves one unpaired)."""
    require_kernel(family, torch.bfloat16, head_dim)
    torch.manual_seed(head_dim + 1)
    for len_q, len_k in ((300, 300), (400, 400), (640, 4500), (1024, 1024), (1025, 1025), (2048, 2048), (2049, 2049),
                         (2200, 2200), (4300, 700)):
        check(1, 4, 2, len_q, len_k, head_dim, torch.bfloat16, True, "blhe")


@pytest.mark.parametrize("head_dim", (128, 256))
def test_row_max_moves_on_the_last_key_tiles(family, head_dim):
    """The sm90 forward visits key tiles from the last to the first, and at head dim
    256 skips O's rescale for a warp none of whose rows moved its max. Here the first
    40 keys share a direction with the queries of every third 16-row group (one warp's
    rows of a 64-row slab), so those rows find their max on the last tiles visited
    while the other warps' rows see ordinary scores."""
    require_kernel(family, torch.bfloat16, head_dim)
    torch.manual_seed(head_dim + 2)
    len_q, len_k = 700, 2000
    q = randn(1, 2, len_q, head_dim, torch.bfloat16, "blhe")
    k = randn(1, 2, len_k, head_dim, torch.bfloat16, "blhe")
    v = randn(1, 2, len_k, head_dim, torch.bfloat16, "blhe")
    u = torch.randn(head_dim, device="cuda")
    u = (u * head_dim**0.5 / u.norm()).to(torch.bfloat16)
    rows = (torch.arange(len_q, device="cuda") // 16) % 3 == 0
    q[:, :, rows] += u
    k[:, :, :40] += u
    out, lse = fwd(q, k, v)
    torch.cuda.synchronize()
    check_out(f"late max E={head_dim}", q, k, v, out, lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gqa_layouts_scale(family, head_dim, dtype, causal):
    require_kernel(family, dtype, head_dim)
    torch.manual_seed(1 + head_dim)
    check(2, 8, 2, 300, 257, head_dim, dtype, causal, "blhe")
    check(2, 4, 1, 129, 1000, head_dim, dtype, causal, "bhle")
    check(1, 4, 4, 200, 333, head_dim, dtype, causal, "bhle", scale=0.3)
    check(1, 4, 4, 65, 64, head_dim, dtype, causal, "blhe", scale=-0.2)


@pytest.mark.parametrize("head_dim", (64, 128))
def test_padded_row_strides(family, head_dim):
    """Rows further apart than E (a slice of a wider buffer), heads and batch strided apart."""
    require_kernel(family, torch.bfloat16, head_dim)
    torch.manual_seed(2)
    wide = torch.randn(3, 2, 5, 150, 2 * head_dim + 8, device="cuda", dtype=torch.bfloat16)
    q = wide[:, 0, :4, :, :head_dim]
    k = wide[:, 1, 1:3, :, 8:8 + head_dim]
    v = wide[:, 1, 3:5, :, head_dim:2 * head_dim]
    for causal in (False, True):
        out, lse = fwd(q, k, v, None, causal)
        check_out(f"strided causal={causal}", q, k, v, out, lse, None, causal)


def test_size_one_dims_with_any_stride(family):
    """A dim of size 1 is never stepped along, so its stride need not be a multiple of 8."""
    require_kernel(family, torch.float16, 64)
    torch.manual_seed(5)
    flat = torch.randn(4 * 77 * 64 + 64, device="cuda", dtype=torch.float16)
    q = flat.as_strided((1, 4, 77, 64), (3, 77 * 64, 64, 1))
    k = flat.as_strided((1, 1, 50, 64), (5, 7, 64, 1), 64)
    v = flat.as_strided((1, 1, 50, 64), (1, 1, 64, 1), 128)
    one_row = flat.as_strided((2, 4, 1, 64), (256, 64, 3, 1))
    k2, v2 = (torch.randn(2, 1, 50, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    for causal in (False, True):
        out, lse = fwd(q, k, v, None, causal)
        check_out(f"size-1 dims causal={causal}", q, k, v, out, lse, None, causal)
        out, lse = fwd(one_row, k2, v2, None, causal)
        check_out(f"one query row causal={causal}", one_row, k2, v2, out, lse, None, causal)


def test_output_layout_and_no_stray_writes(family):
    """out is a (B, L, H, E) buffer seen as (B, H, L, E); repeated calls agree bit for bit."""
    require_kernel(family, torch.float16, 64)
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 3, 77, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out1, lse1 = fwd(q, k, v, None, True)
    out2, lse2 = fwd(q, k, v, None, True)
    assert out1.transpose(1, 2).is_contiguous() and lse1.is_contiguous()
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


def test_batch_beyond_grid_limit(family):
    """More batches than a grid dimension holds (65535)."""
    require_kernel(family, torch.bfloat16, 64)
    torch.manual_seed(4)
    q, k, v = (torch.randn(65537, 2, 3, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = fwd(q, k, v, None, False)
    check_out("batch 65537", q, k, v, out, lse)


def test_family_runs_its_own_kernels(family):
    """The family the op is given is the one that runs: the launched kernels are the pinned family's."""
    require_kernel(family, torch.bfloat16, 128)
    q, k, v = (torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert _router.pinned_families(q, k, v) == (family, None)
    launched = testing.launched_families(lambda: fwd(q, k, v, None, True))
    assert launched == {family}, f"pinned {family}, launched {launched}"
    with testing.kernel_families():  # the setting does not reach the op: its argument does
        by_name = lambda: torch.ops.torch_flash_backend.fwd(q, k, v, None, True, family)
        assert testing.launched_families(by_name) == {family}


def test_op_runs_the_named_family_only():
    """The CUDA ops choose nothing: family=None raises, naming the families;
    the router's choice (flash_attn's) moves past sm90 for a stride-0 K."""
    require_kernel("sm80", torch.bfloat16, 128)
    q, k, v = (torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(RuntimeError, match=r"runs the family its caller names, and family is None \(families: "):
        torch.ops.torch_flash_backend.fwd(q, k, v, None, True)
    out = torch.ops.torch_flash_backend.fwd(q, k, v, None, True, _router.pinned_families(q, k, v)[0])[0]
    with pytest.raises(RuntimeError, match=r"the forward's backward_family is None"):
        torch.ops.torch_flash_backend.bwd(out, q, k, v, out, torch.zeros(2, 4, 256, device="cuda"), None, True)
    kx = k[:1].expand(2, -1, -1, -1)  # past sm90's TMA
    launched = testing.launched_families(lambda: tfb.flash_attn(q, kx, v, is_causal=True))
    assert launched == {"sm80"}, launched


def test_op_family_argument_errors():
    """A family that cannot run the call raises, naming it and why."""
    require_kernel("sm80", torch.bfloat16, 128)
    ops = torch.ops.torch_flash_backend
    q, k, v = (torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(RuntimeError, match=r"family='sm80' has no forward kernel for bf16 head dims q/k 36, v 36"):
        ops.fwd(q[..., :36], k[..., :36], v[..., :36], None, False, "sm80")
    with pytest.raises(RuntimeError, match=r"family='cpu' has no CUDA forward kernels; these do: .*sm80"):
        ops.fwd(q, k, v, None, False, "cpu")
    if "sm90_fwd_bf16_hdim128" in tfb.built_kernels():
        if torch.cuda.get_device_capability() != (9, 0):
            with pytest.raises(RuntimeError, match=r"family='sm90' does not run on compute capability .* "
                                                   r"\(it runs on 9.0\)"):
                ops.fwd(q, k, v, None, False, "sm90")
        else:
            with pytest.raises(RuntimeError, match=r"family='sm90' cannot run these inputs \(a stride "
                                                   r"of 0"):
                ops.fwd(q, k[:, :1].expand(1, 2, 64, 128), v, None, False, "sm90")
    # The forward carries the backward's family to its autograd formula.
    qg = q.clone().requires_grad_()
    forward = _router.pinned_families(q, k, v, needs_grad=False)[0]
    out, _ = ops.fwd(qg, k, v, None, False, forward, "decode")
    with pytest.raises(RuntimeError, match=r"family='decode' has no CUDA backward kernels"):
        out.sum().backward()
    if "sm80_bwd_bf16_hdim128" in tfb.built_kernels():
        out, _ = ops.fwd(qg, k, v, None, False, forward, "sm80")
        out.sum().backward()
        assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_default_forward_is_sm90_on_hopper():
    require_kernel("sm90", torch.bfloat16, 128)
    q, k, v = (torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    decision = tfb.explain(q, k, v, is_causal=True)
    assert decision.kernel == "sm90_fwd_bf16_hdim128", str(decision)
    assert str(decision).startswith("served by sm90_fwd_bf16_hdim128 (")
    with tfb.enable(strict=True):
        launched = testing.launched_families(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert "sm90" in launched, f"explain says sm90, launched {launched}"


def _misaligned_inputs():
    """(what, offending argument, q, k, v): views the kernels cannot read with 16-byte vectors."""
    e = 64
    rows68 = torch.randn(2, 4, 130, e + 4, device="cuda", dtype=torch.bfloat16)[..., :e]
    flat = torch.randn(2 * 4 * 130 * e + 4, device="cuda", dtype=torch.bfloat16)
    shifted = flat[4:].view(2, 4, 130, e)  # starts 8 bytes past an aligned address
    odd_rows = torch.randn(2, 130, 4 * e + 2, device="cuda", dtype=torch.bfloat16)[..., :4 * e]
    odd_rows = odd_rows.view(2, 130, 4, e).transpose(1, 2)  # a (B, L, H, E) buffer with rows 4E + 2 apart
    aligned = torch.randn(2, 4, 130, e, device="cuda", dtype=torch.bfloat16)
    return [("row stride 68", "q", rows68, aligned, aligned),
            ("storage offset 4", "k", aligned, shifted, aligned),
            ("(B, L, H, E) rows 258 apart", "v", aligned, aligned, odd_rows)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_misaligned_views_give_right_answers(causal):
    """Under enable() (default families) misaligned views are served or fall back to
    PyTorch, and either way the answer is right; the op itself answers right or
    raises an error naming the argument."""
    if "sm80_fwd_bf16_hdim64" not in tfb.built_kernels():
        pytest.skip("sm80_fwd_bf16_hdim64 not built")
    torch.manual_seed(6)
    for what, arg, q, k, v in _misaligned_inputs():
        decision = tfb.explain(q, k, v, is_causal=causal)
        with tfb.enable():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        ref_out, _ = attention_ref(q, k, v, None, causal)
        baseline = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert_within_baseline(f"{what} ({decision})", out, baseline, ref_out)
        try:
            out, lse = fwd(q, k, v, None, causal)
        except RuntimeError as err:
            assert re.search(rf"\b{arg}\b", str(err)), f"{what}: the error does not name {arg}: {err}"
        else:
            check_out(f"{what}, op called directly", q, k, v, out, lse, None, causal)


def test_broadcast_kv_default_families():
    """K/V shared by every batch through expand() (batch stride 0), under enable()."""
    if "sm80_fwd_bf16_hdim128" not in tfb.built_kernels():
        pytest.skip("sm80_fwd_bf16_hdim128 not built")
    torch.manual_seed(7)
    q = torch.randn(3, 4, 200, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.bfloat16).expand(3, -1, -1, -1)
            for _ in range(2))
    for causal in (False, True):
        decision = tfb.explain(q, k, v, is_causal=causal)
        assert decision.served and not decision.kernel.startswith("sm90"), str(decision)
        out = None

        def call():
            nonlocal out
            with tfb.enable():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        # explain names the family that actually runs.
        assert testing.launched_families(call) == {decision.kernel.split("_")[0]}
        ref_out, _ = attention_ref(q, k, v, None, causal)
        baseline = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert_within_baseline(f"broadcast K/V causal={causal} ({decision})", out, baseline, ref_out)
