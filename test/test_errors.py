"""Bad input gets a clear error naming the argument, from the functional entry and
from the ops themselves; empty inputs behave like PyTorch's SDPA."""
import pytest
import torch
import torch.nn.functional as F

import torch_flash_backend as tfb
from torch_flash_backend import testing

ops = torch.ops.torch_flash_backend


def qkv(b=2, hq=4, hkv=4, length=20, s=20, e=16, dtype=torch.float32):
    return (torch.randn(b, hq, length, e, dtype=dtype), torch.randn(b, hkv, s, e, dtype=dtype),
            torch.randn(b, hkv, s, e, dtype=dtype))


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="v has dtype torch.bfloat16 but q has torch.float32"):
        tfb.flash_attn(q, k, v.bfloat16())


def test_unsupported_dtype():
    with pytest.raises(ValueError, match="q has dtype torch.float64"):
        tfb.flash_attn(*qkv(dtype=torch.float64))


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k must be 4-D .* got shape \(4, 20, 16\)"):
        tfb.flash_attn(q, k[0], v)


def test_head_dims_differ():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k head_dim \(8\) must equal q head_dim \(16\)"):
        tfb.flash_attn(q, k[..., :8].contiguous(), v)
    # v's may differ (test_head_dims.py): out takes it.
    assert tfb.flash_attn(q, k, v[..., :8].contiguous()).shape[-1] == 8


def test_heads_not_a_multiple():
    with pytest.raises(ValueError, match=r"q heads \(6\) must be a multiple of k/v heads \(4\)"):
        tfb.flash_attn(*qkv(hq=6, hkv=4))


def test_batch_and_lengths_differ():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="batch sizes differ"):
        tfb.flash_attn(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="k has length 20 but v has length 10"):
        tfb.flash_attn(q, k, v[:, :, :10])


def test_last_dim_not_contiguous():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k must be contiguous in its last dim"):
        tfb.flash_attn(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)


def test_devices_differ():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        tfb.flash_attn(q, k.to("meta"), v)


def test_bad_types_and_scale():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        tfb.flash_attn(q.numpy(), k, v)
    with pytest.raises(ValueError, match="scale must be finite"):
        tfb.flash_attn(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        tfb.flash_attn(q, k, v, is_causal=None)


def test_ops_check_their_arguments():
    """The compiled impls check too (for calls that bypass Python, e.g. AOTInductor)."""
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"k head_dim \(8\) must equal q head_dim \(16\)"):
        ops.fwd(q, k[..., :8].contiguous(), v)
    with pytest.raises(RuntimeError, match="q must be 4-D"):
        ops.fwd(q[0], k, v)
    out, lse = ops.fwd(q, k, v)
    with pytest.raises(RuntimeError, match="lse must have shape"):
        ops.bwd(out, q, k, v, out, lse[:, :2].contiguous())
    with pytest.raises(RuntimeError, match="lse must be a float32 tensor"):
        ops.bwd(out, q, k, v, out, lse.double())


def test_ops_family_argument_on_cpu():
    """On CPU the only kernel family is "cpu"; another raises, naming it."""
    q, k, v = qkv()
    out, lse = ops.fwd(q, k, v, None, False, "cpu", "cpu")
    torch.testing.assert_close(out, ops.fwd(q, k, v)[0])
    with pytest.raises(RuntimeError, match=r"family='sm80' cannot run on CPU; the CPU kernels' family is 'cpu'"):
        ops.fwd(q, k, v, None, False, "sm80")
    with pytest.raises(RuntimeError, match=r"family='sm90' cannot run on CPU"):
        ops.fwd(q, k, v, None, False, "cpu", "sm90")
    with pytest.raises(RuntimeError, match=r"family='sm80' cannot run on CPU"):
        ops.bwd(out, q, k, v, out, lse, None, False, "sm80")


@pytest.mark.parametrize("shape", [dict(b=0), dict(hq=0, hkv=0), dict(length=0), dict(s=0)],
                         ids=["batch", "heads", "query", "keys"])
def test_zero_size_like_pytorch(shape):
    q, k, v = (t.requires_grad_() for t in qkv(**shape))
    # PyTorch's CPU SDPA dies with SIGFPE on zero heads (torch 2.11); its math path does not.
    sdpa = torch.ops.aten._scaled_dot_product_attention_math if q.size(1) == 0 else F.scaled_dot_product_attention
    ref = sdpa(q, k, v)
    ref = ref[0] if isinstance(ref, tuple) else ref
    out = tfb.flash_attn(q, k, v)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_enable_keeps_pytorch_errors():
    """Calls our kernels cannot serve go to PyTorch, which reports its own errors."""
    q, k, v = qkv(hq=4, hkv=2)
    with pytest.raises(RuntimeError) as plain:
        F.scaled_dot_product_attention(q, k, v)
    with testing.route_cpu(), tfb.enable(), pytest.raises(RuntimeError) as routed:
        F.scaled_dot_product_attention(q, k, v)
    assert str(routed.value) == str(plain.value)
