"""Shared by the graph tests (test_graph_capture.py, test_export.py): a small
Hugging Face-style attention module, its inputs, the routed context, and the
device fixture whose GPU twin needs the sm80 head dim 64 kernels."""

import contextlib
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import normalize_gm

import torch_flash_backend as tfb
from torch_flash_backend import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.join(ROOT, "torch_flash_backend", "lib", "libtorch_flash_backend.so")

# Head dim 64 is in every trimmed build we document; L >= 17 is routed on GPUs.
B, L, HEADS, KV_HEADS, HEAD_DIM = 2, 24, 4, 2, 64
OPS = torch.ops.torch_flash_backend


class Attention(nn.Module):
    """Attention as Hugging Face models write it: projections in (B, L, H, E),
    transposed to SDPA's (B, H, L, E), GQA, causal."""

    def __init__(self):
        super().__init__()
        dim = HEADS * HEAD_DIM
        self.q_proj = nn.Linear(dim, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(dim, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(dim, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, dim, bias=False)

    def forward(self, x):
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


def _dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def make_model(device):
    torch.manual_seed(0)
    model = Attention().to(device=device, dtype=_dtype(device))
    x = torch.randn(B, L, HEADS * HEAD_DIM, device=device, dtype=_dtype(device))
    return model, x


@contextlib.contextmanager
def routed(device):
    """enable(strict=True), so a call that falls back fails with its reason."""
    with contextlib.ExitStack() as stack:
        if device == "cpu":
            stack.enter_context(testing.route_cpu())
        stack.enter_context(tfb.enable(strict=True))
        yield


def run_with_grads(fn, model, x):
    """Output and the gradients of x and every parameter for a fixed output gradient."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = fn(x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    out.backward(grad)
    return out.detach(), [x.grad] + [p.grad for p in model.parameters()]


def assert_close(actual, expected, device, loose=False):
    """loose: against PyTorch's own SDPA, which rounds and sums in another order.
    In bfloat16 that differs by a few units in the last place of the largest values."""
    actual = actual if isinstance(actual, list) else [actual]
    expected = expected if isinstance(expected, list) else [expected]
    for a, e in zip(actual, expected, strict=True):
        if device == "cuda":
            rtol, atol = 2e-2, (2e-2 * e.abs().max().item() if loose else 2e-2)
        else:
            rtol = atol = 1e-4 if loose else 1e-5
        torch.testing.assert_close(a.float(), e.float(), rtol=rtol, atol=atol)


def targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def assert_routed(gm, ours):
    names = targets(gm)
    assert [t for t in names if t.startswith("torch_flash_backend.")] == ours, names
    assert not [t for t in names if "scaled_dot_product" in t], names


def graph_text(gm):
    # The GPU twins run bfloat16 with their device's kernel families; their
    # graphs must match the float32 CPU ones but for those.
    text = normalize_gm(gm.print_readable(print_output=False)).replace('"bf16[', '"f32[')
    return re.sub(r"'(cpu|sm\d+)'", "'<family>'", text)


@pytest.fixture(scope="module", autouse=True)
def _trust_cpuinfo():
    # Inductor otherwise proves each CPU vector ISA by building a probe library
    # and loading it in a fresh Python, once per process: ~30 s on 2 cores.
    with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
        yield


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda":
        wanted = {f"sm80_{p}_bf16_hdim{HEAD_DIM}" for p in ("fwd", "bwd")}
        missing = wanted - set(tfb.built_kernels())
        if missing:
            pytest.skip(f"the library was built without {sorted(missing)}")
    return request.param




def _needs_cxx():
    """Inductor compiles C++ for CPU graphs and for AOTInductor's wrapper: a
    machine without a compiler (an installed wheel's environment) cannot run it."""
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "g++", "clang++")):
        pytest.skip("no C++ compiler on PATH: Inductor cannot compile")
