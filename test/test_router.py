"""Router decisions, one test per reason, on CUDA FakeTensors (metadata only, no GPU)
with the device capability and the built kernels injected."""
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_flash_backend as tfb
from torch_flash_backend import _router, testing


@pytest.fixture(autouse=True)
def all_families(monkeypatch):
    monkeypatch.delenv(_router.FAMILIES_ENV, raising=False)


@pytest.fixture
def fake():
    with FakeTensorMode(), testing.pretend_cuda(capability=(8, 0)):
        yield


SM80 = testing.registry_kernel_names("sm80")
SM90 = testing.registry_kernel_names("sm90")
SM90_FWD = [n for n in SM90 if n.startswith("sm90_fwd")]


def qkv(b=2, hq=4, hkv=4, length=64, s=64, e=64, dtype=torch.bfloat16, device="cuda", requires_grad=False):
    def make(h, n):
        return torch.empty(b, h, n, e, dtype=dtype, device=device, requires_grad=requires_grad)
    return make(hq, length), make(hkv, s), make(hkv, s)


def reason(*args, **kwargs):
    d = tfb.explain(*args, **kwargs)
    assert not d.served and d.kernel is None, str(d)
    assert str(d) == f"falls back to PyTorch SDPA: {d.reason}"
    return d.reason


def test_served(fake):
    d = tfb.explain(*qkv(hq=8, hkv=2), is_causal=True, enable_gqa=True)
    assert d.served and d.kernel == "sm80_fwd_bf16_hdim64", str(d)
    assert str(d).startswith("served by sm80_fwd_bf16_hdim64 (") and "causal" in str(d) and "GQA 8:2" in str(d)


def test_served_layouts(fake):
    b, h, length, e = 2, 4, 100, 128
    blhe = torch.empty(b, length, h, e, dtype=torch.float16, device="cuda").transpose(1, 2)
    assert tfb.explain(blhe, blhe, blhe).served
    packed = torch.empty(b, length, 3, h, e, dtype=torch.float16, device="cuda")  # fused qkv projection
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
    assert tfb.explain(q, k, v).served
    assert tfb.explain(*qkv(length=17, s=1)).served


def test_cpu_falls_back():
    assert reason(*qkv(device="cpu")) == _router.CPU_REASON


def test_cpu_routed_under_test_switch():
    with testing.route_cpu():
        d = tfb.explain(*qkv(device="cpu", dtype=torch.float32))
    assert d.served and d.kernel == "cpu_fwd_fp32_hdim64"


def test_nested():
    """Nested jagged inputs are explained as the packed call they make
    (test_varlen.py); mixed with dense ones, not at all."""
    nt = torch.nested.nested_tensor([torch.empty(4, 20, 64), torch.empty(4, 30, 64)], layout=torch.jagged)
    assert "nested" in reason(nt, nt, torch.empty(2, 4, 30, 64))


def test_not_4d(fake):
    q, k, v = qkv()
    assert "4-D" in reason(q[0], k[0], v[0])


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="with CUDA up, a FakeTensor on cuda:1 needs that device to exist")
def test_devices_differ(fake):
    q, k, v = qkv()
    assert "different devices" in reason(q, k, v.to("cuda:1"))


def test_other_device_type(fake):
    assert "not CUDA" in reason(*qkv(device="meta"))


def test_capability(fake):
    with testing.pretend_cuda(capability=(7, 5)):
        assert "compute capability 7.5 < 8.0" in reason(*qkv())


def test_no_cuda_kernels_built(fake):
    with testing.pretend_cuda(kernels=[]):
        assert "no CUDA kernels were built" in reason(*qkv())


def test_dtype(fake):
    assert "dtype torch.float32 is not supported" in reason(*qkv(dtype=torch.float32))


def test_dtypes_differ(fake):
    q, k, v = qkv()
    assert "dtypes differ" in reason(q, k, v.half())


def test_value_head_dim_unlike_the_querys(fake):
    q, k, _ = qkv()
    v = torch.empty(2, 4, 64, 32, dtype=q.dtype, device="cuda")
    d = tfb.explain(q, k, v)  # test_head_dims.py has the rest
    assert d.kernel == "sm80_fwd_bf16_hdim64" and "head dims 64 (q, k) and 32 (v)" in d.reason, str(d)


def test_head_dim_not_built(fake):
    assert reason(*qkv(e=36)) == ("no kernel has head dim 36 for bf16; head dims built: 32, 64, 96, 128, 192, 256 "
                                  "(a smaller multiple of 8 runs on the next larger)")
    assert tfb.explain(*qkv(e=72)).kernel == "sm80_fwd_bf16_hdim96"  # test_head_dims.py has the rest


def test_attn_mask(fake):
    """sm80 reads a boolean mask and an additive one; an additive one of
    another dtype than q's or float32 falls back (PyTorch's SDPA rejects it)."""
    q, k, v = qkv()
    mask = torch.empty(64, 64, dtype=torch.bool, device="cuda")
    d = tfb.explain(q, k, v, attn_mask=mask)
    assert d.kernel == "sm80_fwd_bf16_hdim64" and "boolean attn_mask" in str(d), str(d)
    d = tfb.explain(q, k, v, attn_mask=mask.to(torch.bfloat16))
    assert d.kernel == "sm80_fwd_bf16_hdim64" and "additive attn_mask (bf16)" in str(d), str(d)
    assert "attn_mask must be a bool tensor" in reason(q, k, v, attn_mask=mask.to(torch.float16))


def test_dropout(fake):
    # Served by the families that draw it (test_dropout.py); outside (0, 1) PyTorch decides.
    assert "dropout_p=1.0 is outside (0, 1)" in reason(*qkv(), dropout_p=1.0)


def test_gqa_needs_flag(fake):
    assert "enable_gqa=False" in reason(*qkv(hq=8, hkv=2))


def test_gqa_ratio(fake):
    # PyTorch's SDPA rejects it too: an error naming the argument, not a fallback.
    with pytest.raises(ValueError, match=r"key's head count \(size -3, here 4\) to divide query's \(6\)"):
        reason(*qkv(hq=6, hkv=4), enable_gqa=True)


def test_shape_mismatch(fake):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"value's length \(size -2\) is 10 but key's is 64"):
        reason(q, k, v[:, :, :10])
    assert "shapes do not match" in reason(q, k[:1], v[:1])


def test_last_dim_not_contiguous(fake):
    q, k, v = qkv()
    assert "q is not contiguous in its last dim" in reason(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)


def test_stride_not_multiple_of_8(fake):
    q, k, v = qkv()
    odd = torch.empty(2, 4, 64, 68, dtype=q.dtype, device="cuda")[..., :64]
    assert "stride(2) = 68 is not a multiple of 8" in reason(q, odd, v)


def test_storage_offset(fake):
    q, k, v = qkv()
    flat = torch.empty(2 * 4 * 64 * 64 + 4, dtype=q.dtype, device="cuda")
    shifted = flat[4:].view(2, 4, 64, 64)
    assert "storage offset 4" in reason(q, k, shifted)


def test_zero_size(fake):
    assert "zero-size" in reason(*qkv(b=0))
    assert "zero-size" in reason(*qkv(s=0))


def test_short_query(fake):
    assert reason(*qkv(length=16)) == _router.DECODE_REASON
    assert reason(*qkv(length=1, s=1000)) == _router.DECODE_REASON


DECODE = testing.registry_kernel_names("decode")


def test_short_query_served_by_decode(fake, monkeypatch):
    """Below MIN_QUERY_LEN the decode family serves, up to 256 rows per kv head
    (group heads x query length); the tiled forwards never do, and the backward
    is sm80's. One query token falls back by default (PyTorch's SDPA is faster
    there) and is served with probe.route_single_tokens."""
    with testing.pretend_cuda(capability=(9, 0), kernels=DECODE + SM80 + SM90_FWD):
        assert reason(*qkv(length=1, s=1000)) == _router.DECODE_SLOWER_REASON
        # strict enable(): our kernels or an error, so what is ours to serve is served.
        assert tfb.explain(*qkv(length=1, s=1000), strict=True).kernel == "decode_fwd_bf16_hdim64"
        assert tfb.explain(*qkv(length=2, s=1000)).kernel == "decode_fwd_bf16_hdim64"
        assert _router.pinned_families(*qkv(length=1)) == ("decode", None)  # flash_attn: any family that can
        # Head dim 256 against 32 MiB of K and V or more: the decode kernel is the faster, and serves.
        big = qkv(b=1, hq=32, hkv=8, length=1, s=4096, e=256)
        assert tfb.explain(*big, enable_gqa=True).kernel == "decode_fwd_bf16_hdim256"
        assert reason(*qkv(b=1, hq=32, hkv=8, length=1, s=4095, e=256), enable_gqa=True) == _router.DECODE_SLOWER_REASON
        mask = torch.ones(1, 1, 1, 4096, dtype=torch.bool, device="cuda")
        assert reason(*big, attn_mask=mask, enable_gqa=True) == _router.DECODE_SLOWER_REASON
        monkeypatch.setattr(_router.probe, "route_single_tokens", True)
        assert tfb.explain(*qkv(length=1, s=1000)).kernel == "decode_fwd_bf16_hdim64"
        assert tfb.explain(*qkv(hq=16, hkv=4, length=4, s=300), enable_gqa=True).kernel == "decode_fwd_bf16_hdim64"
        d = tfb.explain(*qkv(length=16, requires_grad=True))
        assert (d.kernel, d.backward_kernel) == ("decode_fwd_bf16_hdim64", "sm80_bwd_bf16_hdim64"), str(d)
        assert d.family == "decode" and d.backward_family == "sm80"
        assert tfb.explain(*qkv(hq=16, hkv=2, length=4), enable_gqa=True).kernel == "decode_fwd_bf16_hdim64"
        assert tfb.explain(*qkv(hq=16, hkv=2, length=16), enable_gqa=True).kernel == "decode_fwd_bf16_hdim64"
        assert "past 128 the decode kernel" in reason(*qkv(hq=32, hkv=2, length=16), enable_gqa=True)
        assert reason(*qkv(hq=64, hkv=2, length=16), enable_gqa=True) == (
            "short query with 512 query rows per KV head (group heads x query length); the decode kernel serves "
            "at most 256 and PyTorch's SDPA serves it faster than the tiled forwards")
        assert tfb.explain(*qkv(length=17)).kernel == "sm90_fwd_bf16_hdim64"
        with testing.kernel_families("sm80", "sm90"):
            assert reason(*qkv(length=1)) == _router.DECODE_REASON
            # flash_attn with pinned families: whatever family can run it.
            assert _router.pinned_families(*qkv(length=1)) == ("sm90", None)
        with testing.kernel_families("decode", "sm80"):
            assert _router.pinned_families(*qkv(length=1)) == ("decode", None)
            assert _router.pinned_families(*qkv(hq=16, hkv=2, length=4), enable_gqa=True) == ("decode", None)
            assert _router.pinned_families(*qkv(hq=64, hkv=2, length=16), enable_gqa=True) == ("sm80", None)
            assert _router.pinned_families(*qkv(length=64)) == ("sm80", None)  # 64 rows, but not a short query


def test_backward_not_built(fake):
    with testing.pretend_cuda(kernels=["sm80_fwd_bf16_hdim64"]):
        assert tfb.explain(*qkv()).served
        assert "no backward kernel" in reason(*qkv(requires_grad=True))
        with torch.no_grad():
            assert tfb.explain(*qkv(requires_grad=True)).served


def test_capability_lookup_failure(fake):
    def broken(device):
        raise RuntimeError("no driver")
    saved = _router.probe.capability
    _router.probe.capability = broken
    try:
        assert "cannot query the compute capability" in reason(*qkv())
    finally:
        _router.probe.capability = saved


def test_backward_needs_shared_memory(fake):
    # An Ada part: the forward fits, the sm80 backward tiles do not.
    with testing.pretend_cuda(capability=(8, 9), smem_per_block=99 * 1024):
        assert tfb.explain(*qkv()).served
        assert "shared memory" in reason(*qkv(requires_grad=True))


def test_hopper_forward_sm90_backward_sm80(fake):
    """With the sm90 forwards alone built beside sm80 (a build before the sm90
    backward, or TFB_KERNEL_FAMILIES allowing both), sm80 serves the backward."""
    with testing.pretend_cuda(capability=(9, 0), kernels=SM80 + SM90_FWD):
        d = tfb.explain(*qkv(e=128))
        assert d.served and d.kernel == "sm90_fwd_bf16_hdim128" and d.backward_kernel is None, str(d)
        assert "backward" not in str(d)
        d = tfb.explain(*qkv(hq=8, hkv=2, e=128, requires_grad=True), is_causal=True, enable_gqa=True)
        assert d.kernel == "sm90_fwd_bf16_hdim128" and d.backward_kernel == "sm80_bwd_bf16_hdim128", str(d)
        assert str(d) == "served by sm90_fwd_bf16_hdim128 (bf16, head dim 128, causal, GQA 8:2, " \
                         "backward by sm80_bwd_bf16_hdim128)"
        with torch.no_grad():
            assert tfb.explain(*qkv(e=128, requires_grad=True)).backward_kernel is None
        # sm90 has no head dim 32: sm80's own serves both directions (before sm90's 64, padded).
        d = tfb.explain(*qkv(e=32, dtype=torch.float16, requires_grad=True))
        assert (d.kernel, d.backward_kernel) == ("sm80_fwd_fp16_hdim32", "sm80_bwd_fp16_hdim32"), str(d)


def test_hopper_sm90_both_ways_where_it_has_a_backward(fake):
    with testing.pretend_cuda(capability=(9, 0), kernels=SM80 + SM90):
        for e in (64, 80, 96, 128, 192, 256):
            d = tfb.explain(*qkv(hq=8, hkv=2, e=e, requires_grad=True), is_causal=True, enable_gqa=True)
            assert (d.kernel, d.backward_kernel) == (f"sm90_fwd_bf16_hdim{e}", f"sm90_bwd_bf16_hdim{e}"), str(d)
    # A build without an sm90 backward for a head dim: sm80's serves it.
    without = [n for n in SM90 if n != "sm90_bwd_bf16_hdim256"]
    with testing.pretend_cuda(capability=(9, 0), kernels=SM80 + without):
        d = tfb.explain(*qkv(e=256, requires_grad=True))
        assert (d.kernel, d.backward_kernel) == ("sm90_fwd_bf16_hdim256", "sm80_bwd_bf16_hdim256"), str(d)
    with testing.pretend_cuda(capability=(9, 0), kernels=SM80 + SM90):
        # Inputs broadcast with stride 0: sm80 both ways (TMA cannot read them).
        q, k, v = qkv(e=128, requires_grad=True)
        d = tfb.explain(q, k[:, :1].expand(k.shape), v)
        assert (d.kernel, d.backward_kernel) == ("sm80_fwd_bf16_hdim128", "sm80_bwd_bf16_hdim128"), str(d)
    with testing.pretend_cuda(capability=(9, 0), kernels=SM90), testing.kernel_families("sm90"):
        q, k, v = qkv(e=128, requires_grad=True)
        assert reason(q, k[:, :1].expand(k.shape), v).startswith("an input is broadcast with stride 0")


def test_hopper_without_sm90_kernels(fake):
    with testing.pretend_cuda(capability=(9, 0), kernels=SM80):
        assert tfb.explain(*qkv()).kernel == "sm80_fwd_bf16_hdim64"
        d = tfb.explain(*qkv(requires_grad=True))
        assert (d.kernel, d.backward_kernel) == ("sm80_fwd_bf16_hdim64", "sm80_bwd_bf16_hdim64"), str(d)
    # Only a few sm90 forwards built: the rest are sm80's.
    with testing.pretend_cuda(capability=(9, 0), kernels=SM80 + ["sm90_fwd_bf16_hdim128"]):
        assert tfb.explain(*qkv(e=128)).kernel == "sm90_fwd_bf16_hdim128"
        assert tfb.explain(*qkv(e=128, dtype=torch.float16)).kernel == "sm80_fwd_fp16_hdim128"
        assert tfb.explain(*qkv(e=64)).kernel == "sm80_fwd_bf16_hdim64"


def test_hopper_broadcast_kv_goes_to_sm80(fake):
    # TMA descriptors cannot step by 0: expand()ed K/V are read by sm80 on Hopper.
    with testing.pretend_cuda(capability=(9, 0), kernels=SM80 + SM90_FWD):
        q, k, v = qkv(b=3, e=128)
        k, v = (t[:1].expand(3, -1, -1, -1) for t in (k, v))
        assert tfb.explain(q, k, v).kernel == "sm80_fwd_bf16_hdim128"
        assert tfb.explain(q[:1].expand(3, -1, -1, -1), *qkv(b=3, e=128)[1:]).kernel == "sm80_fwd_bf16_hdim128"
        # A size-1 dim's stride is never stepped along, whatever it is.
        q1, k1, v1 = qkv(b=1, e=128)
        assert tfb.explain(q1, k1.expand(1, -1, -1, -1), v1).kernel == "sm90_fwd_bf16_hdim128"
    with testing.pretend_cuda(capability=(9, 0), kernels=SM90_FWD):
        assert "stride 0 (expand), which the sm90 forward cannot read" in reason(q, k, v)


def test_hopper_sm90_forward_without_any_backward(fake):
    with testing.pretend_cuda(capability=(9, 0), kernels=SM90_FWD):
        assert tfb.explain(*qkv()).kernel == "sm90_fwd_bf16_hdim64"
        assert "no backward kernel was built for bf16 head dim 64" in reason(*qkv(requires_grad=True))


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)])
def test_sm90_only_on_hopper(fake, capability):
    # sm_90a code runs on compute capability 9.0 alone, whatever else was built.
    with testing.pretend_cuda(capability=capability, kernels=SM80 + SM90_FWD):
        for grad in (False, True):
            d = tfb.explain(*qkv(e=128, requires_grad=grad))
            assert d.kernel == "sm80_fwd_bf16_hdim128", str(d)
    with testing.pretend_cuda(capability=capability, kernels=SM90_FWD):
        assert "no kernel has head dim 128 for bf16" in reason(*qkv(e=128))


def test_kernel_families_pins_sm80(fake):
    with testing.pretend_cuda(capability=(9, 0), kernels=SM80 + SM90_FWD):
        with testing.kernel_families("sm80"):
            d = tfb.explain(*qkv(e=128, requires_grad=True))
            assert (d.kernel, d.backward_kernel) == ("sm80_fwd_bf16_hdim128", "sm80_bwd_bf16_hdim128"), str(d)
            with testing.kernel_families():  # no names: every family again
                assert tfb.explain(*qkv(e=128)).kernel == "sm90_fwd_bf16_hdim128"
            assert tfb.explain(*qkv(e=128)).kernel == "sm80_fwd_bf16_hdim128"
        with testing.kernel_families("sm80", "sm90"):
            assert tfb.explain(*qkv(e=128)).kernel == "sm90_fwd_bf16_hdim128"
        assert tfb.explain(*qkv(e=128)).kernel == "sm90_fwd_bf16_hdim128"


def test_kernel_families_pins_sm90(fake):
    with testing.pretend_cuda(capability=(9, 0), kernels=SM80 + SM90_FWD), testing.kernel_families("sm90"):
        assert tfb.explain(*qkv(e=128)).kernel == "sm90_fwd_bf16_hdim128"
        # sm90 has no backward for head dim 96, and sm80 is not allowed to serve one.
        assert reason(*qkv(e=96, requires_grad=True)) == (
            "inputs require grad but no backward kernel was built for bf16 head dim 96 "
            "(families allowed by TFB_KERNEL_FAMILIES: sm90)")
        assert reason(*qkv(e=36)) == ("no kernel has head dim 36 for bf16 (families allowed by "
                                      "TFB_KERNEL_FAMILIES: sm90); head dims built: 64, 80, 96, 128, 192, 256 "
                                      "(a smaller multiple of 8 runs on the next larger)")
    with testing.pretend_cuda(capability=(8, 0)), testing.kernel_families("sm90"):
        assert "TFB_KERNEL_FAMILIES='sm90' allows none of the kernel families for compute capability 8.0" \
            in reason(*qkv())


def test_kernel_families_environment(fake, monkeypatch):
    with testing.pretend_cuda(capability=(9, 0), kernels=SM80 + SM90_FWD):
        monkeypatch.setenv(_router.FAMILIES_ENV, " sm80 ,")
        assert tfb.explain(*qkv()).kernel == "sm80_fwd_bf16_hdim64"
        monkeypatch.setenv(_router.FAMILIES_ENV, "")
        assert tfb.explain(*qkv()).kernel == "sm90_fwd_bf16_hdim64"
        monkeypatch.setenv(_router.FAMILIES_ENV, "sm100")
        assert "allows none of the kernel families" in reason(*qkv())


def test_kernel_families_restores_environment(monkeypatch):
    env = _router.FAMILIES_ENV
    with testing.kernel_families("sm80"):
        assert os.environ[env] == "sm80"
        with testing.kernel_families("sm90", "sm80"):
            assert os.environ[env] == "sm90,sm80"
        assert os.environ[env] == "sm80"
    assert env not in os.environ
    monkeypatch.setenv(env, "sm90")
    with pytest.raises(KeyError), testing.kernel_families("sm80"):
        raise KeyError("the previous value comes back on errors too")
    assert os.environ[env] == "sm90"
    with pytest.raises(ValueError, match="unknown kernel families"):
        with testing.kernel_families("sm8O"):
            pass


@testing.kernel_families("sm80")
def test_kernel_families_as_decorator():
    assert _router.allowed_families() == {"sm80"}


def test_kernel_records():
    """built_kernels() lines parse into records the router reads; the families
    and their limits come from the library (src/registry.py at build time)."""
    from torch_flash_backend import _library

    k = _library.Kernel.parse("sm90_fwd_bf16_hdim128 family=sm90 pass=fwd dtype=bf16 head_dim=128 min_cc=90 "
                              "max_cc=90 stride0_ok=false align_bytes=16 smem_bytes=0")
    assert k == "sm90_fwd_bf16_hdim128" and (k.family, k.pass_, k.dtype, k.head_dim) == ("sm90", "fwd", "bf16", 128)
    assert k.runs_on((9, 0)) and not k.runs_on((10, 0)) and not k.runs_on((8, 6)) and not k.stride0_ok
    assert _router.families() == ("decode", "sm90", "sm80")
    assert _router._families((9, 0)) == ("decode", "sm90", "sm80")
    assert _router._families((12, 0)) == ("decode", "sm80")
    bwd = next(iter(testing.fake_kernels(["sm80_bwd_fp16_hdim96"], smem_bytes={"bwd": 128 * 1024})))
    assert bwd.stride0_ok and bwd.min_cc == 80 and bwd.max_cc == 0 and bwd.smem_bytes == 128 * 1024


def test_decisions_are_cached_by_metadata_and_settings(monkeypatch):
    """A call decided before gets the same decision back; its shapes, strides, the
    probe and the settings are the key, never the tensors' values."""
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))

    def cached(q):  # the decision's number in the cache, -1 for none
        return torch.ops.torch_flash_backend.routing_lookup(q, k, v, None, 0.0, False, False, None, False, False,
                                                            -1, -1, False)

    with testing.route_cpu():
        assert cached(q) == -1
        first = tfb.explain(q, k, v)
        assert first.served and cached(q) >= 0
        assert tfb.explain(q, k, v) is first
        assert cached(torch.randn_like(q)) == cached(q)
        assert cached(q[:, :, :18]) == -1
        assert tfb.explain(q, k, v, is_causal=True).reason != first.reason
        monkeypatch.setenv(_router.FAMILIES_ENV, "sm80")
        assert cached(q) == -1
    assert not tfb.explain(q, k, v).served  # route_cpu left: the probe moved on


def test_one_decision_cache(monkeypatch):
    """decide() keeps its decisions in the op library's cache, the one enable()'s
    eager calls read without Python: a call explain() decided runs under enable()
    without asking the router again, and counts under that decision."""
    import torch.nn.functional as F

    ops = torch.ops.torch_flash_backend
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    with testing.route_cpu():
        decision = tfb.explain(q, k, v, is_causal=True)
        assert decision.served
        number = ops.routing_lookup(q, k, v, None, 0.0, True, False, None, False, False, -1, -1, False)
        assert number >= 0 and _router.numbered()[number] == decision
        # Other settings are other keys: flash_attn's choice, a window, grad.
        assert ops.routing_lookup(q, k, v, None, 0.0, True, False, None, False, False, -1, -1, True) == -1
        assert ops.routing_lookup(q, k, v, None, 0.0, True, False, None, False, False, 3, -1, False) == -1
        assert ops.routing_lookup(q, k, v, None, 0.0, True, False, None, True, False, -1, -1, False) == -1

        def ask(*args, **kwargs):
            raise AssertionError("the router was asked again")

        monkeypatch.setattr(_router, "_decide", ask)
        tfb.reset_stats()
        with tfb.enable(strict=True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert tfb.stats()["routed"] == {decision.kernel: 1}
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        assert tfb.explain(q, k, v, is_causal=True) == decision


def test_kernel_records_say_which_masks_a_pass_reads():
    """The registry's masks and additive_masks reach each record: sm90's
    backward reads a boolean mask, not an additive one; every other masked
    pass reads both; no pass refuses a call without a mask."""
    records = {str(k): k for k in testing.fake_kernels(
        ["sm90_fwd_bf16_hdim128", "sm90_bwd_bf16_hdim128", "sm80_bwd_bf16_hdim128", "decode_fwd_bf16_hdim128"])}
    reads = {name: tuple(k.reads_mask(kind) for kind in ("", "bool", "additive")) for name, k in records.items()}
    assert reads == {"sm90_fwd_bf16_hdim128": (True, True, True), "sm90_bwd_bf16_hdim128": (True, True, False),
                     "sm80_bwd_bf16_hdim128": (True, True, True), "decode_fwd_bf16_hdim128": (True, True, True)}


def test_boolean_masks_served(fake, monkeypatch):
    """A boolean mask on a short query goes to the decode family, on a longer
    one to sm90's forward on Hopper (sm80's elsewhere), and grad to the first
    backward that reads it: sm90's for a boolean mask, sm80's for an additive
    one (sm90's backward reads boolean masks alone); a mask of a float dtype
    SDPA rejects and a mask with is_causal fall back, each with its reason, as
    does a call whose allowed families read no such mask. flash_attn's pinned
    choice follows the same rules."""
    with testing.pretend_cuda(capability=(9, 0), kernels=DECODE + SM80 + SM90):
        mask = torch.empty(2, 1, 4, 1000, dtype=torch.bool, device="cuda")
        d = tfb.explain(*qkv(length=4, s=1000), attn_mask=mask)
        assert d.kernel == "decode_fwd_bf16_hdim64" and "boolean attn_mask" in str(d), str(d)
        assert _router.pinned_families(*qkv(length=4, s=1000), mask) == ("decode", None)
        d = tfb.explain(*qkv(length=4, s=1000, requires_grad=True), attn_mask=mask)
        assert (d.kernel, d.backward_kernel) == ("decode_fwd_bf16_hdim64", "sm90_bwd_bf16_hdim64"), str(d)
        d = tfb.explain(*qkv(length=17, s=1000, requires_grad=True), attn_mask=mask[:, :, :1])
        assert (d.kernel, d.backward_kernel) == ("sm90_fwd_bf16_hdim64", "sm90_bwd_bf16_hdim64"), str(d)
        additive = mask[:, :, :1].to(torch.bfloat16)
        d = tfb.explain(*qkv(length=17, s=1000, requires_grad=True), attn_mask=additive)
        assert (d.kernel, d.backward_kernel) == ("sm90_fwd_bf16_hdim64", "sm80_bwd_bf16_hdim64"), str(d)
        assert _router.pinned_families(*qkv(length=17, s=1000, requires_grad=True), additive) == (
            "sm90", "sm80")
        d = tfb.explain(*qkv(length=4, s=1000), attn_mask=mask.to(torch.bfloat16))
        assert d.kernel == "decode_fwd_bf16_hdim64" and "additive attn_mask (bf16)" in str(d), str(d)
        assert "or float32" in reason(*qkv(length=4, s=1000), attn_mask=mask.to(torch.float16))
        assert "is_causal" in reason(*qkv(length=4, s=1000), attn_mask=mask, is_causal=True)
        assert reason(*qkv(length=1, s=1000), attn_mask=mask[:, :, :1]) == _router.DECODE_SLOWER_REASON
        monkeypatch.setenv(_router.FAMILIES_ENV, "decode,sm90")
        d = tfb.explain(*qkv(length=4, s=1000, requires_grad=True), attn_mask=mask)
        assert d.backward_kernel == "sm90_bwd_bf16_hdim64", str(d)
        assert reason(*qkv(length=4, s=1000, requires_grad=True), attn_mask=mask.to(torch.bfloat16)) == \
            _router.MASK_GRAD_REASON
        with pytest.raises(RuntimeError, match="require grad"):
            _router.pinned_families(*qkv(length=4, s=1000, requires_grad=True), mask.to(torch.bfloat16))
        monkeypatch.setenv(_router.FAMILIES_ENV, "decode")
        assert reason(*qkv(length=17, s=1000), attn_mask=mask[:, :, :1]) == _router.MASK_LONG_QUERY_REASON
        monkeypatch.delenv(_router.FAMILIES_ENV)
        monkeypatch.setattr(_router.probe, "route_single_tokens", True)
        assert tfb.explain(*qkv(length=1, s=1000), attn_mask=mask[:, :, :1]).kernel == "decode_fwd_bf16_hdim64"
    with testing.pretend_cuda(capability=(8, 0), kernels=DECODE + SM80):
        d = tfb.explain(*qkv(length=17, s=1000, requires_grad=True), attn_mask=mask[:, :, :1])
        assert (d.kernel, d.backward_kernel) == ("sm80_fwd_bf16_hdim64", "sm80_bwd_bf16_hdim64"), str(d)


@pytest.mark.parametrize("b,hq,hkv,length,s,mask_shape", [
    (2, 8, 2, 1, 100, (2, 1, 1, 100)),     # a cache's mask per batch row, GQA 4
    (1, 4, 4, 3, 37, (1, 4, 3, 37)),       # per head, S not a whole number of tiles
    (2, 32, 2, 4, 64, (64,)),              # 64 rows per kv head: four row tiles, one key vector
    (1, 6, 2, 5, 50, (5, 50)),             # 15 rows: one partial row tile
])
def test_mask_tiles_skipped_counts_the_decode_kernels_tiles(b, hq, hkv, length, s, mask_shape):
    """explain()'s share of hidden key tiles, against a loop over the decode
    kernel's (row tile, 16-key tile) pairs: rows are a kv head's query rows,
    position-major with the group's heads within."""
    torch.manual_seed(0)
    q, k = torch.empty(b, hq, length, 8), torch.empty(b, hkv, s, 8)
    mask = torch.rand(mask_shape) > 0.8
    mask[..., :16] = False  # whole hidden tiles, so that the share is not 0
    full = mask.expand(b, hq, length, s)
    group, rows = hq // hkv, length * hq // hkv
    hidden = total = 0
    for bi in range(b):
        for h in range(hkv):
            for row0 in range(0, rows, 16):
                for key0 in range(0, s, 16):
                    seen = any(bool(full[bi, h * group + r % group, r // group, key0:key0 + 16].any())
                               for r in range(row0, min(row0 + 16, rows)))
                    hidden += not seen
                    total += 1
    assert _router.mask_tiles_skipped(mask, q, k, 16, 16, group_packed=True) == pytest.approx(hidden / total)
    assert hidden > 0


def test_mask_tiles_skipped_counts_a_tiled_kernels_tiles():
    """For a tiled family the rows of a tile are one query head's."""
    torch.manual_seed(1)
    b, hq, hkv, length, s, tm, tn = 2, 4, 2, 200, 150, 128, 64
    q, k = torch.empty(b, hq, length, 8), torch.empty(b, hkv, s, 8)
    mask = torch.zeros(b, 1, length, s, dtype=torch.bool)
    mask[0, :, 5, 70] = mask[0, :, 150, 140] = True  # one visible pair in two tiles
    mask[1, :, :, :64] = True
    full = mask.expand(b, hq, length, s)
    hidden = total = 0
    for bi in range(b):
        for h in range(hq):
            for row0 in range(0, length, tm):
                for key0 in range(0, s, tn):
                    hidden += not bool(full[bi, h, row0:row0 + tm, key0:key0 + tn].any())
                    total += 1
    assert 0 < hidden < total
    assert _router.mask_tiles_skipped(mask, q, k, tm, tn, group_packed=False) == pytest.approx(hidden / total)


def test_fake_ops_want_a_family_on_cuda():
    """The fake kernels check what the CUDA ops check: they run the family
    their caller names, and raise without one (the router chooses; empty calls
    need none)."""
    ops = torch.ops.torch_flash_backend
    with FakeTensorMode():
        q = torch.empty(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match=r"forward op runs the family its caller names, and family is None"):
            ops.fwd(q, q, q)
        out, lse = ops.fwd(q, q, q, None, False, "sm80")
        with pytest.raises(RuntimeError, match=r"the forward's backward_family is None"):
            ops.bwd(out, q, q, q, out, lse)
        ops.bwd(out, q, q, q, out, lse, None, False, "sm80")
        empty = q[:, :, :0]
        ops.fwd(empty, q, q)
