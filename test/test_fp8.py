"""FP8 attention on the CPU side: the ops' fake kernels (bfloat16 outputs in
the strides the kernels write), explain()'s reasons, the registry's FP8
records. GPU tests: test_cuda_fp8.py."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_flash_backend as tfb
from torch_flash_backend import _fp8

ops = torch.ops.torch_flash_backend
FP8 = torch.float8_e4m3fn


def test_fake_fp8_fwd_returns_bfloat16_in_blhe_memory():
    with FakeTensorMode():
        q = torch.empty(2, 3, 40, 128, dtype=FP8)
        k = torch.empty(2, 1, 50, 128, dtype=FP8)
        d = torch.empty(2, 1)
        out, lse = ops.fp8_fwd(q, k, k, d, d, d, None, True, True)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 40, 128)
    assert out.stride() == torch.empty(2, 40, 3, 128).transpose(1, 2).stride()
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 40)


def test_fake_fp8_fwd_checks_descales_and_dtype():
    with FakeTensorMode():
        q = torch.empty(2, 4, 40, 128, dtype=FP8)
        with pytest.raises(RuntimeError, match="q_descale must have shape"):
            ops.fp8_fwd(q, q, q, torch.empty(2, 3))
        with pytest.raises(RuntimeError, match="float8_e4m3fn"):
            b = torch.empty(2, 4, 40, 128, dtype=torch.bfloat16)
            ops.fp8_fwd(b, b, b)


def test_fake_fp8_varlen_fwd_shapes():
    with FakeTensorMode():
        q = torch.empty(100, 4, 64, dtype=FP8)
        k = torch.empty(90, 2, 64, dtype=FP8)
        cu = torch.empty(4, dtype=torch.int32)
        out, lse = ops.fp8_varlen_fwd(q, k, k, cu, cu, 50, 50, torch.empty(3, 2))
    assert out.dtype == torch.bfloat16 and out.shape == (100, 4, 64)
    assert lse.shape == (4, 100)


def test_explain_names_why_fp8_falls_back():
    q = torch.empty(1, 2, 8, 128, dtype=FP8)
    assert "off CUDA" in tfb.explain(q, q, q).reason
    decision = _fp8.decide(q, q, q, dropout_p=0.1)
    assert not decision.served


def test_layout_problems_name_the_tensor_and_stride():
    t = torch.empty(1, 2, 8, 136, dtype=FP8)[..., :128]
    assert _fp8._layout_problem(t, "key", False) == "key stride(2) = 136 is not a multiple of 16 elements (16 bytes)"
    assert _fp8._layout_problem(torch.empty(1, 2, 8, 128, dtype=FP8), "query", False) is None
    assert "stride 0" in _fp8._layout_problem(torch.empty(1, 1, 8, 128, dtype=FP8).expand(2, 2, 8, 128), "v", False)
    assert _fp8._layout_problem(torch.empty(40, 2, 64, dtype=FP8), "query", True) is None


def test_registry_lists_fp8_kernels_where_sm90_is_built():
    kernels = tfb.built_kernels()
    if not any(k.family == "sm90" for k in kernels):
        pytest.skip("built without the sm90 family")
    fp8 = {k.head_dim for k in kernels if k.dtype == "fp8"}
    assert fp8 == {64, 128, 256}
    assert all(k.family == "sm90" and k.pass_ == "fwd" for k in kernels if k.dtype == "fp8")


def test_transpose_offsets_match_the_rings_layouts(host_check):
    """src/sm90/transpose_v.h's hand-made byte offsets against the CuTe layouts
    of the FP8 forward's V rings, and a lane-by-lane host replay of the
    transpose: every byte where the wgmma reads it, the loads' and stores' bank
    conflicts counted (test/cpp/transpose_layout_check.cu)."""
    out = host_check("transpose_layout_check")
    assert out.strip().splitlines()[-1] == "ok", out
