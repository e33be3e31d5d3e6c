"""The sm80 forward kernel against the float64 reference.

The output's error must stay within 2x the error of PyTorch's own SDPA in the
same dtype (plus a 1e-5 floor); lse is float32 throughout, so it gets a fixed
tolerance. Head dims left out of the build are skipped.
"""
import pytest
import torch
import torch.nn.functional as F

from reference import assert_within_baseline, attention_ref, max_err

pytestmark = pytest.mark.gpu

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPES = (torch.float16, torch.bfloat16)
LENGTHS = (1, 17, 127, 128, 129, 1000)
LSE_TOL = 1e-3


def fwd(q, k, v, scale=None, is_causal=False):
    import torch_flash_backend  # noqa: F401  (loads the op library)

    return torch.ops.torch_flash_backend.fwd(q, k, v, scale, is_causal)


def require_kernel(dtype, head_dim):
    import torch_flash_backend  # noqa: F401

    name = f"sm80_fwd_{'fp16' if dtype == torch.float16 else 'bf16'}_hdim{head_dim}"
    if name not in torch.ops.torch_flash_backend.built_kernels():
        pytest.skip(f"{name} not built")


def randn(batch, heads, length, head_dim, dtype, layout):
    """(B, H, L, E) contiguous, or the (B, L, H, E).transpose(1, 2) view."""
    if layout == "bhle":
        return torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
    return torch.randn(batch, length, heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)


def check(batch, heads_q, heads_kv, len_q, len_k, head_dim, dtype, causal, layout, scale=None):
    q = randn(batch, heads_q, len_q, head_dim, dtype, layout)
    k = randn(batch, heads_kv, len_k, head_dim, dtype, layout)
    v = randn(batch, heads_kv, len_k, head_dim, dtype, layout)
    out, lse = fwd(q, k, v, scale, causal)
    torch.cuda.synchronize()
    ref_out, ref_lse = attention_ref(q, k, v, scale, causal)
    baseline = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=heads_q != heads_kv)
    name = f"B={batch} H={heads_q}/{heads_kv} L={len_q} S={len_k} E={head_dim} {dtype} causal={causal} {layout}"
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_within_baseline(name, out, baseline, ref_out)
    assert lse.shape == ref_lse.shape
    assert max_err(lse, ref_lse) <= LSE_TOL, f"{name}: lse error {max_err(lse, ref_lse):.3e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_lengths(head_dim, dtype, causal):
    """Every pair of odd and tile-edge lengths, L < S, L == S and L > S."""
    require_kernel(dtype, head_dim)
    torch.manual_seed(head_dim)
    for len_q in LENGTHS:
        for len_k in LENGTHS:
            layout = "bhle" if (len_q + len_k) % 2 else "blhe"
            check(1, 2, 2, len_q, len_k, head_dim, dtype, causal, layout)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gqa_layouts_scale(head_dim, dtype, causal):
    require_kernel(dtype, head_dim)
    torch.manual_seed(1 + head_dim)
    check(2, 8, 2, 300, 257, head_dim, dtype, causal, "blhe")
    check(2, 4, 1, 129, 1000, head_dim, dtype, causal, "bhle")
    check(1, 4, 4, 200, 333, head_dim, dtype, causal, "bhle", scale=0.3)
    check(1, 4, 4, 65, 64, head_dim, dtype, causal, "blhe", scale=-0.2)


@pytest.mark.parametrize("head_dim", (64, 128))
def test_padded_row_strides(head_dim):
    """Rows further apart than E (a slice of a wider buffer), heads and batch strided apart."""
    require_kernel(torch.bfloat16, head_dim)
    torch.manual_seed(2)
    wide = torch.randn(3, 2, 5, 150, 2 * head_dim + 8, device="cuda", dtype=torch.bfloat16)
    q = wide[:, 0, :4, :, :head_dim]
    k = wide[:, 1, 1:3, :, 8:8 + head_dim]
    v = wide[:, 1, 3:5, :, head_dim:2 * head_dim]
    for causal in (False, True):
        out, lse = fwd(q, k, v, None, causal)
        ref_out, ref_lse = attention_ref(q, k, v, None, causal)
        baseline = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        assert_within_baseline(f"strided causal={causal}", out, baseline, ref_out)
        assert max_err(lse, ref_lse) <= LSE_TOL


def test_output_layout_and_no_stray_writes():
    """out is a (B, L, H, E) buffer seen as (B, H, L, E); repeated calls agree bit for bit."""
    require_kernel(torch.float16, 64)
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 3, 77, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out1, lse1 = fwd(q, k, v, None, True)
    out2, lse2 = fwd(q, k, v, None, True)
    assert out1.transpose(1, 2).is_contiguous() and lse1.is_contiguous()
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


def test_batch_beyond_grid_limit():
    """More batches than a grid dimension holds (65535) are launched in slices."""
    require_kernel(torch.bfloat16, 64)
    torch.manual_seed(4)
    q, k, v = (torch.randn(65537, 2, 3, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = fwd(q, k, v, None, False)
    ref_out, ref_lse = attention_ref(q, k, v)
    baseline = F.scaled_dot_product_attention(q, k, v)
    assert_within_baseline("batch 65537", out, baseline, ref_out)
    assert max_err(lse, ref_lse) <= LSE_TOL
