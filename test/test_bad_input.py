"""SDPA calls that PyTorch rejects raise a Python exception naming the argument
under enable() and enable(strict=True), never a signal. PyTorch 2.11 itself dies
on some of them (SIGSEGV, SIGFPE), so each call runs in a child process and the
test reads its exit status.
"""
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_flash_backend as tfb

# name -> (code building q, k, v, kwargs on `dev`, the text the error must hold)
CASES = {
    "head dim 32 views against 64": (
        "q = torch.randn(2, 8, 128, 64, device=dev, dtype=dt)\n"
        "k = torch.randn(2, 8, 128, 64, device=dev, dtype=dt)[..., :32]\n"
        "v = torch.randn(2, 8, 128, 64, device=dev, dtype=dt)[..., :32]\n"
        "kw = {}",
        "key's head dim (size -1) is 32 but query's is 64"),
    "key head dim 128 with enable_gqa": (
        "q = torch.randn(2, 8, 128, 64, device=dev, dtype=dt)\n"
        "k = torch.randn(2, 2, 128, 128, device=dev, dtype=dt)\n"
        "v = torch.randn(2, 2, 128, 64, device=dev, dtype=dt)\n"
        "kw = {'enable_gqa': True}",
        "key's head dim (size -1) is 128 but query's is 64"),
    "zero kv heads with enable_gqa": (
        "q = torch.randn(2, 8, 128, 64, device=dev, dtype=dt)\n"
        "k = torch.randn(2, 0, 128, 64, device=dev, dtype=dt)\n"
        "v = torch.randn(2, 0, 128, 64, device=dev, dtype=dt)\n"
        "kw = {'enable_gqa': True}",
        "key's head count (size -3, here 0)"),
    "kv heads not dividing with enable_gqa": (
        "q = torch.randn(2, 6, 128, 64, device=dev, dtype=dt)\n"
        "k = torch.randn(2, 4, 128, 64, device=dev, dtype=dt)\n"
        "v = torch.randn(2, 4, 128, 64, device=dev, dtype=dt)\n"
        "kw = {'enable_gqa': True}",
        "key's head count (size -3, here 4) to divide query's (6)"),
    "value length differs": (
        "q = torch.randn(2, 8, 128, 64, device=dev, dtype=dt)\n"
        "k = torch.randn(2, 8, 128, 64, device=dev, dtype=dt)\n"
        "v = torch.randn(2, 8, 100, 64, device=dev, dtype=dt)\n"
        "kw = {}",
        "value's length (size -2) is 100 but key's is 128"),
}

SCRIPT = """
import torch, torch.nn.functional as F, torch_flash_backend as tfb
from torch_flash_backend import testing
dev, dt = {device!r}, {dtype}
{build}
with testing.route_cpu(), tfb.enable(strict={strict}):
    try:
        F.scaled_dot_product_attention(q, k, v, **kw)
    except Exception as e:
        print(type(e).__name__ + ": " + str(e))
    else:
        print("no error")
"""


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rejected_call_raises_not_crashes(device, strict, case):
    build, message = CASES[case]
    dtype = "torch.float32" if device == "cpu" else "torch.bfloat16"
    code = SCRIPT.format(device=device, dtype=dtype, build=build, strict=strict)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"child died with status {run.returncode}: {run.stderr[-2000:]}"
    assert run.stdout.startswith("ValueError: ") and message in run.stdout, run.stdout


@pytest.mark.gpu
def test_unbuilt_head_dim_is_the_reason():
    q = torch.randn(2, 8, 128, 20, device="cuda", dtype=torch.bfloat16)
    reason = tfb.explain(q, q, q).reason
    assert reason.startswith("no kernel has head dim 20"), reason
