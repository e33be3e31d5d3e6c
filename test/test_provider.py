"""The torch.nn.attention provider: registration, activation bookkeeping, and the
overriding kernels' outputs against PyTorch's meta functions (CUDA FakeTensors);
the real CUDA behaviour is a GPU test."""
import pytest
import torch
import torch.nn.attention as A
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_flash_backend as tfb
from torch_flash_backend import _provider, testing

OPS = _provider._OPS


def cuda_kernel_sources():
    return {op: [line for line in torch._C._dispatch_dump(f"aten::{op}").splitlines() if line.startswith("CUDA")]
            for op in OPS}


@pytest.fixture
def restore():
    yield
    A.restore_flash_attention_impl(_raise_warn=False)


def test_registered_not_activated():
    assert "torch_flash_backend" in A.list_flash_attention_impls()
    assert A.current_flash_attention_impl() != "torch_flash_backend"


def test_activate_and_restore(restore):
    before = cuda_kernel_sources()
    A.activate_flash_attention_impl("torch_flash_backend")
    assert A.current_flash_attention_impl() == "torch_flash_backend"
    for op, lines in cuda_kernel_sources().items():
        assert "_provider.py" in lines[0], (op, lines)
    A.activate_flash_attention_impl("torch_flash_backend")  # re-activation replaces, never stacks
    assert sum("_provider.py" in line for lines in cuda_kernel_sources().values() for line in lines) == len(OPS)
    A.restore_flash_attention_impl()
    assert A.current_flash_attention_impl() is None
    assert cuda_kernel_sources() == before


def test_handle_remove_is_idempotent():
    handle = _provider.register()
    assert _provider.active()
    handle.remove()
    handle.remove()
    assert not _provider.active()
    # The SDPA flash ops get PyTorch's kernels back; the flash ops keep the switch (test_varlen.py).
    sources = cuda_kernel_sources()
    assert all("_provider.py" not in line for op in OPS[len(_provider._SWITCH_OPS):] for line in sources[op])


class Recorder:
    """Stands in for PyTorch's original kernel: records that it was called."""

    def __init__(self):
        self.calls = []

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "original"


@pytest.fixture
def kernels():
    originals = {op: Recorder() for op in OPS}
    with FakeTensorMode(), testing.pretend_cuda():
        yield _provider._make_kernels(originals), originals


KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def same_meta(ours, meta):
    assert len(ours) == len(meta)
    for a, b in zip(ours, meta):
        if isinstance(b, torch.Tensor):
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        else:
            assert a == b


def bhle(b, h, n, e, layout):
    if layout == "blhe":
        return torch.empty(b, n, h, e, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    return torch.empty(b, h, n, e, dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("layout", ["bhle", "blhe"])
def test_sdpa_flash_outputs_match_meta(kernels, layout):
    ours, originals = kernels
    q, k, v = bhle(2, 8, 64, 64, layout), bhle(2, 2, 80, 64, layout), bhle(2, 2, 80, 64, layout)
    fwd = ours["_scaled_dot_product_flash_attention"](KEYSET, q, k, v, 0.0, False, False, scale=None)
    meta = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)
    same_meta(fwd[:6], meta[:6])
    out, lse = fwd[0], fwd[1]
    grads = ours["_scaled_dot_product_flash_attention_backward"](
        KEYSET, torch.empty_like(out), q, k, v, out, lse, None, None, 64, 80, 0.0, False, fwd[6], fwd[7], scale=None)
    same_meta(grads, (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))
    assert not any(r.calls for r in originals.values())


def test_flash_forward_outputs_match_meta(kernels):
    ours, originals = kernels
    q, k, v = (torch.empty(2, n, h, 64, dtype=torch.float16, device="cuda") for n, h in ((64, 4), (64, 4), (64, 4)))
    fwd = ours["_flash_attention_forward"](KEYSET, q, k, v, None, None, 64, 64, 0.0, True, False)
    meta = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 64, 64, 0.0, True, False)
    same_meta(fwd[:2], meta[:2])
    grads = ours["_flash_attention_backward"](KEYSET, torch.empty_like(q), q, k, v, fwd[0], fwd[1], None, None,
                                              64, 64, 0.0, True, fwd[2], fwd[3])
    same_meta(grads, (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))
    assert not any(r.calls for r in originals.values())


def test_varlen_outputs_match_meta(kernels):
    """A packed batch (cum_seq_q / cum_seq_k, as varlen_attn and nested jagged
    SDPA pass it): outputs as PyTorch's meta functions give them, GQA."""
    ours, originals = kernels
    q = torch.empty(70, 8, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.empty(90, 2, 64, dtype=torch.bfloat16, device="cuda")
    cu_q, cu_k = (torch.empty(3, dtype=torch.int32, device="cuda") for _ in range(2))
    fwd = ours["_flash_attention_forward"](KEYSET, q, k, k, cu_q, cu_k, 40, 50, 0.0, True, False,
                                           window_size_left=8, window_size_right=0)
    meta = torch.ops.aten._flash_attention_forward(q, k, k, cu_q, cu_k, 40, 50, 0.0, True, False)
    same_meta(fwd[:2], meta[:2])
    grads = ours["_flash_attention_backward"](KEYSET, torch.empty_like(q), q, k, k, fwd[0], fwd[1], cu_q, cu_k, 40,
                                              50, 0.0, True, fwd[2], fwd[3], window_size_left=8, window_size_right=0)
    same_meta(grads, (torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)))
    assert not any(r.calls for r in originals.values())


def test_unserved_calls_go_to_the_original(kernels):
    ours, originals = kernels
    q = torch.empty(2, 4, 64, 64, dtype=torch.bfloat16, device="cuda")
    sdpa = ours["_scaled_dot_product_flash_attention"]
    assert sdpa(KEYSET, q, q, q, 1.0, False, False, scale=None) == "original"  # dropout_p outside (0, 1)
    assert sdpa(KEYSET, q, q, q, 0.0, False, True, scale=None) == "original"  # debug mask
    assert sdpa(KEYSET, q[:, :, :8], q, q, 0.0, True, False, scale=None) == "original"  # short query
    assert len(originals["_scaled_dot_product_flash_attention"].calls) == 3
    # Dropout is served (test_dropout.py), its seed output the op's rng_state as PyTorch's kernel packs it.
    served = sdpa(KEYSET, q, q, q, 0.1, False, False, scale=None)
    assert served != "original" and served[6].dtype == torch.uint64 and served[6].shape == (2,)
    # Causal with L != S is served: PyTorch's flash ops align it bottom-right, as the ops' bottom_right=True.
    assert sdpa(KEYSET, q[:, :, :32], q, q, 0.0, True, False, scale=None) != "original"
    blhe = q.transpose(1, 2)
    fwd = ours["_flash_attention_forward"]
    # A window is a band the kernels read (test_windows.py).
    assert fwd(KEYSET, blhe, blhe, blhe, None, None, 64, 64, 0.0, False, False, window_size_left=16) != "original"
    offsets = torch.zeros(2, dtype=torch.int32, device="cuda")
    # A packed batch goes to the families that read per-sequence lengths (sm80, sm90's forward), not to decode's.
    assert fwd(KEYSET, blhe[0], blhe[0], blhe[0], offsets, offsets, 64, 64, 0.0, False, False) != "original"
    with testing.pretend_cuda(capability=(9, 0), kernels=["decode_fwd_bf16_hdim64"]):
        assert fwd(KEYSET, blhe[0], blhe[0], blhe[0], offsets, offsets, 64, 64, 0.0, False, False) == "original"
    assert fwd(KEYSET, blhe[0], blhe[0], blhe[0], offsets.long(), offsets, 64, 64, 0.0, False, False) == "original"
    with testing.pretend_cuda(capability=(7, 5)):
        assert fwd(KEYSET, blhe, blhe, blhe, None, None, 64, 64, 0.0, False, False) == "original"
    with testing.pretend_cuda(kernels=["sm80_fwd_bf16_hdim64"]):
        bwd = ours["_scaled_dot_product_flash_attention_backward"]
        lse = torch.empty(2, 4, 64, device="cuda")
        assert bwd(KEYSET, q, q, q, q, q, lse, None, None, 64, 64, 0.0, False, lse, lse, scale=None) == "original"


def test_calls_count_in_stats_and_log(kernels, caplog):
    """Served and passed-on calls through the hook count in stats() and log at
    DEBUG, as enable()'s do."""
    ours, _ = kernels
    q = torch.empty(2, 4, 64, 64, dtype=torch.bfloat16, device="cuda")
    sdpa = ours["_scaled_dot_product_flash_attention"]
    tfb.reset_stats()
    with caplog.at_level("DEBUG", logger="torch_flash_backend"):
        sdpa(KEYSET, q, q, q, 0.0, True, False, scale=None)
        sdpa(KEYSET, q, q, q, 0.0, False, True, scale=None)
        sdpa(KEYSET, q[:, :, :32], q, q, 0.0, True, False, scale=None)
    stats = tfb.stats()
    assert stats["routed"] == {"sm80_fwd_bf16_hdim64": 2}, stats
    assert stats["fallback"] == {"return_debug_mask=True is not supported": 1}
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("provider: flash attention forward served by sm80_fwd_bf16_hdim64") for m in lines), lines
    assert sum("passed on to PyTorch's kernel" in m for m in lines) == 1, lines


def test_backward_counts_under_the_backward_kernel(kernels):
    ours, _ = kernels
    q = torch.empty(2, 4, 64, 64, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(2, 4, 64, device="cuda")
    seed, offset = torch.empty(2, dtype=torch.uint64, device="cuda"), torch.empty((), dtype=torch.uint64, device="cuda")
    tfb.reset_stats()
    ours["_scaled_dot_product_flash_attention"](KEYSET, q, q, q, 0.0, True, False, scale=None)
    ours["_scaled_dot_product_flash_attention_backward"](KEYSET, q, q, q, q, q, lse, None, None, 64, 64, 0.0, True,
                                                          seed, offset, scale=None)
    assert tfb.stats()["routed"] == {"sm80_fwd_bf16_hdim64": 1, "sm80_bwd_bf16_hdim64": 1}, tfb.stats()


@pytest.mark.gpu
def test_cuda_activated_serves_sdpa_flash(restore):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    A.activate_flash_attention_impl("torch_flash_backend")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        dropped = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.5)
    ours = tfb.flash_attn(q, k, v, is_causal=True)
    assert torch.equal(out, ours)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ours, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)  # the backward may accumulate in any order
    assert dropped.isfinite().all()  # dropout stays with PyTorch's kernel
    A.restore_flash_attention_impl()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        again = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(again, ours, atol=2e-2, rtol=2e-2)
