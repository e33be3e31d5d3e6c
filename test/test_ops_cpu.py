"""The CPU impls of torch_flash_backend::fwd and ::bwd against the float64 reference.

fp16/bf16 results may be at most 2x as far from the reference as PyTorch's own
same-dtype SDPA on the same inputs (the rule in test/reference.py); float32 ones must be
within float32 accumulation error. Shapes cover odd lengths, L != S both ways,
head dims 32..256, GQA groups and the three input layouts SDPA users pass.
"""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from reference import assert_within_baseline, attention_ref, max_err

LIB = Path(__file__).resolve().parents[1] / "torch_flash_backend" / "lib" / "libtorch_flash_backend.so"

# float32 results: max abs error relative to the reference's largest magnitude,
# plus twice PyTorch's own float32 error where cancellation makes that larger
# (with a single key dK is 0 in exact arithmetic, a difference of sums here).
F32_RTOL = 2e-5
# fp16/bf16: added to 2x the baseline error, relative to the reference's
# largest magnitude, so that a baseline exact by luck (a single key, say)
# does not demand exactness.
LOW_PRECISION_FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-3}


def _registered():
    return torch._C._dispatch_has_kernel_for_dispatch_key("torch_flash_backend::fwd", "CPU")


@pytest.fixture(scope="module")
def ops():
    # The package loads the library when it is importable; the bare library
    # serves when only the build exists.
    try:
        import torch_flash_backend  # noqa: F401
    except ImportError:
        pass
    if not _registered():
        torch.ops.load_library(str(LIB))
    return torch.ops.torch_flash_backend


def make(b, h, length, e, dtype, layout):
    """A (B, H, L, E) tensor laid out as SDPA callers pass it."""
    if layout == "bhle":
        return torch.randn(b, h, length, e, dtype=dtype)
    if layout == "blhe":  # projections reshaped to heads, as Hugging Face models do
        return torch.randn(b, length, h, e, dtype=dtype).transpose(1, 2)
    if layout == "padded":  # rows further apart than head_dim
        return torch.randn(b, h, length, e + 8, dtype=dtype)[..., :e]
    raise ValueError(layout)


def _cases():
    # A sampled grid: every length pair, head dim, GQA group, layout and
    # causal flag appears, each dtype sees all of them, without the full product.
    lengths = [(1, 1), (17, 17), (127, 127), (128, 128), (129, 129), (300, 300),
               (1, 300), (17, 129), (128, 300), (300, 17), (129, 128), (127, 1)]
    head_dims = [32, 64, 96, 128, 192, 256]
    groups = [(2, 2), (4, 1), (8, 2)]
    layouts = ["bhle", "blhe", "padded"]
    for i, (L, S) in enumerate(lengths):
        hq, hkv = groups[i % 3]
        E, layout = head_dims[i % 6], layouts[i // 3 % 3]
        causal = bool(i // 2 % 2)
        scale = 0.3 if i % 4 == 3 else None
        batch = 2 if i % 2 and L * S < 300 * 300 else 1  # a second batch where it is cheap
        case = dict(b=batch, hq=hq, hkv=hkv, L=L, S=S, E=E, causal=causal, scale=scale, layout=layout)
        name = f"L{L}-S{S}-E{E}-h{hq}:{hkv}-{'causal' if causal else 'full'}-{layout}{'-scale' if scale else ''}"
        yield pytest.param(case, id=name)


DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.float16, torch.bfloat16)]


def _check(name, ours, baseline, ref, dtype):
    magnitude = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    if dtype == torch.float32:
        err, base = max_err(ours, ref), max_err(baseline, ref)
        assert err <= F32_RTOL * magnitude + 2 * base, f"{name}: error {err:.3e}, baseline {base:.3e}"
    else:
        assert_within_baseline(name, ours, baseline, ref, floor=LOW_PRECISION_FLOOR[dtype] * magnitude)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", _cases())
def test_matches_reference(ops, case, dtype):
    c = case
    torch.manual_seed(c["L"] * 1000 + c["S"] + c["E"])
    q = make(c["b"], c["hq"], c["L"], c["E"], dtype, c["layout"])
    k = make(c["b"], c["hkv"], c["S"], c["E"], dtype, c["layout"])
    v = make(c["b"], c["hkv"], c["S"], c["E"], dtype, c["layout"])
    grad = make(c["b"], c["hq"], c["L"], c["E"], dtype, c["layout"])

    out, lse = ops.fwd(q, k, v, c["scale"], c["causal"])
    dq, dk, dv = ops.bwd(grad, q, k, v, out, lse, c["scale"], c["causal"])

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, scale=c["scale"], is_causal=c["causal"])
    ref_out.backward(grad.double())

    base = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base_out = F.scaled_dot_product_attention(*base, is_causal=c["causal"], scale=c["scale"],
                                              enable_gqa=c["hq"] != c["hkv"])
    base_out.backward(grad)

    assert out.dtype == dtype and lse.dtype == torch.float32
    _check("out", out, base_out, ref_out, dtype)
    # lse comes from float32 sums whatever the input dtype.
    assert max_err(lse, ref_lse) <= 1e-5 * max(1.0, ref_lse.abs().max().item())
    for name, ours, b, leaf in zip(("dq", "dk", "dv"), (dq, dk, dv), base, leaves):
        assert ours.dtype == dtype
        _check(name, ours, b.grad, leaf.grad, dtype)


@pytest.mark.parametrize("E", [1, 40, 80])
def test_head_dims_off_the_vector_width(ops, E):
    torch.manual_seed(E)
    q, k, v = (make(1, 2, 70, E, torch.float32, "padded") for _ in range(3))
    out, lse = ops.fwd(q, k, v, None, True)
    grad = torch.randn_like(out)
    dq, dk, dv = ops.bwd(grad, q, k, v, out, lse, None, True)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, is_causal=True)
    ref_out.backward(grad.double())
    for ours, ref in zip((out, lse, dq, dk, dv), (ref_out, ref_lse, *(t.grad for t in leaves))):
        assert max_err(ours, ref) <= F32_RTOL * max(1.0, ref.abs().max().item())


def test_large_scores(ops):
    # Scores in the hundreds: the running max changes from block to block and
    # most exponentials underflow, which only a correct rescaling survives.
    torch.manual_seed(1)
    q = torch.randn(1, 2, 130, 64) * 20
    k, v = (torch.randn(1, 2, 200, 64) for _ in range(2))
    out, lse = ops.fwd(q, k, v)
    grad = torch.randn_like(out)
    dq, dk, dv = ops.bwd(grad, q, k, v, out, lse)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves)
    ref_out.backward(grad.double())
    for ours, ref in zip((out, lse, dq, dk, dv), (ref_out, ref_lse, *(t.grad for t in leaves))):
        assert max_err(ours, ref) <= 1e-4 * max(1.0, ref.abs().max().item())


def test_output_layout(ops):
    q = make(2, 4, 33, 64, torch.float16, "padded")
    k = make(2, 2, 45, 64, torch.float16, "bhle")
    v = make(2, 2, 45, 64, torch.float16, "blhe")
    out, lse = ops.fwd(q, k, v)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32 and lse.is_contiguous()
    dq, dk, dv = ops.bwd(torch.randn_like(out), q, k, v, out, lse)
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert grad.transpose(1, 2).is_contiguous()


def test_default_scale_is_inverse_sqrt_head_dim(ops):
    q, k, v = (torch.randn(1, 2, 19, 48) for _ in range(3))
    out, lse = ops.fwd(q, k, v)
    out_explicit, lse_explicit = ops.fwd(q, k, v, 1.0 / math.sqrt(48))
    torch.testing.assert_close(out, out_explicit, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_explicit, rtol=0, atol=0)


def test_backward_is_deterministic(ops):
    torch.manual_seed(0)
    q = torch.randn(2, 8, 150, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 150, 64, dtype=torch.bfloat16) for _ in range(2))
    out, lse = ops.fwd(q, k, v, None, True)
    grad = torch.randn_like(out)
    first = ops.bwd(grad, q, k, v, out, lse, None, True)
    second = ops.bwd(grad, q, k, v, out, lse, None, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "b,hq,hkv,L,S",
    [(0, 2, 1, 5, 7), (2, 2, 1, 0, 7), (2, 2, 1, 5, 0), (2, 0, 0, 5, 7)],
    ids=["B0", "L0", "S0", "H0"],
)
def test_empty(ops, b, hq, hkv, L, S, causal):
    # No keys: an empty softmax contributes nothing, as PyTorch's SDPA gives.
    q = torch.randn(b, hq, L, 32, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, S, 32, dtype=torch.bfloat16) for _ in range(2))
    out, lse = ops.fwd(q, k, v, None, causal)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    assert lse.shape == (b, hq, L) and lse.dtype == torch.float32
    assert torch.equal(out, torch.zeros_like(q))
    assert bool((lse == -math.inf).all())
    if hq:
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        assert torch.equal(out, expected)
    grads = ops.bwd(torch.randn_like(q), q, k, v, out, lse, None, causal)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.shape == like.shape and torch.equal(grad, torch.zeros_like(like))


def _qkv(hq=4, hkv=2, L=8, S=8, E=32, dtype=torch.float32):
    return torch.randn(2, hq, L, E, dtype=dtype), *(torch.randn(2, hkv, S, E, dtype=dtype) for _ in range(2))


def test_value_head_dim_sets_out_and_grad_out(ops):
    """v's head dim may differ from q's (test_head_dims.py): out has it, and the
    backward wants grad_out and out with it, naming the shape."""
    q, k, v = _qkv()
    out, lse = ops.fwd(q, k, v[..., :16])
    assert out.shape == (2, 4, 8, 16)
    with pytest.raises(RuntimeError, match=r"grad_out shape \[2, 4, 8, 32\] must be \(batch, q heads, L, v "
                                           r"head_dim\) = \[2, 4, 8, 16\]"):
        ops.bwd(torch.randn(q.shape), q, k, v[..., :16], out, lse)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda q, k, v: (q, k.half(), v), r"k has dtype Half but q has Float"),
        (lambda q, k, v: (q, k, v.bfloat16()), r"v has dtype BFloat16 but q has Float"),
        (lambda q, k, v: (q[0], k, v), r"q must be 4-D"),
        (lambda q, k, v: (q, k, v.unsqueeze(0)), r"v must be 4-D"),
        (lambda q, k, v: (q, k[..., :16], v), r"k head_dim \(16\) must equal q head_dim \(32\)"),
        (lambda q, k, v: (q[:, :3], k, v), r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
        (lambda q, k, v: (q.transpose(2, 3).contiguous().transpose(2, 3), k, v),
         r"q must be contiguous in its last dim"),
        (lambda q, k, v: (q, k, v.transpose(2, 3).contiguous().transpose(2, 3)),
         r"v must be contiguous in its last dim"),
        (lambda q, k, v: (q, k, v[:, :, :5]), r"k has length 8 but v has length 5"),
        (lambda q, k, v: (q, k[:1], v[:1]), r"batch sizes differ"),
        (lambda q, k, v: (q.double(), k.double(), v.double()), r"float32, float16 or bfloat16 inputs, got Double"),
    ],
    ids=["k_dtype", "v_dtype", "q_rank", "v_rank", "k_head_dim", "gqa_ratio", "q_last_dim",
         "v_last_dim", "kv_length", "batch", "float64"],
)
def test_bad_inputs(ops, change, match):
    q, k, v = change(*_qkv())
    with pytest.raises(RuntimeError, match=match):
        ops.fwd(q, k, v)
    with pytest.raises(RuntimeError, match=match):
        ops.bwd(torch.randn(q.shape, dtype=q.dtype), q, k, v, torch.randn(q.shape, dtype=q.dtype),
                torch.zeros(q.shape[:3]) if q.dim() == 4 else torch.zeros(1))


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda g, o, lse: (g, o, lse[:, :, :-1]), r"lse must have shape \(2, 4, 8\)"),
        (lambda g, o, lse: (g, o, lse[0]), r"lse must have shape \(2, 4, 8\)"),
        (lambda g, o, lse: (g, o, lse.double()), r"lse must be a float32 tensor"),
        (lambda g, o, lse: (g, o, lse.transpose(1, 2).contiguous().transpose(1, 2)), r"lse must be contiguous"),
        (lambda g, o, lse: (g[:, :, :-1], o, lse), r"grad_out shape .* must be \(batch, q heads, L, v head_dim\)"),
        (lambda g, o, lse: (g, o.half(), lse), r"out has dtype Half but q has Float"),
        (lambda g, o, lse: (g.transpose(2, 3).contiguous().transpose(2, 3), o, lse),
         r"grad_out must be contiguous in its last dim"),
    ],
    ids=["lse_length", "lse_rank", "lse_dtype", "lse_strides", "grad_out_shape", "out_dtype", "grad_out_last_dim"],
)
def test_bad_backward_inputs(ops, change, match):
    q, k, v = _qkv()
    out, lse = ops.fwd(q, k, v)
    grad, out, lse = change(torch.randn_like(out), out, lse)
    with pytest.raises(RuntimeError, match=match):
        ops.bwd(grad, q, k, v, out, lse)


@pytest.mark.gpu
def test_mixed_devices(ops):
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r"k is on cuda:0 but q is on cpu"):
        ops.fwd(q, k.cuda(), v)
