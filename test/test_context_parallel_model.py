"""A Llama-style training step under PyTorch's context parallelism with our provider
active (benchmarks/bench_cp.py under torchrun): loss and gradients against a one-GPU
float32 reference within 2x the error of PyTorch's flash kernels, causal (head-tail
load balancing) and not, and every ring step served by our kernels. Two ranks need two
GPUs; one rank runs the same machinery (a ring of one step) anywhere."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("causal", ["--causal", "--no-causal"])
def test_context_parallel_step(ranks, causal):
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    pytest.importorskip("transformers")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
           os.path.join(ROOT, "benchmarks", "bench_cp.py"), "--seq", str(8192 * ranks), "--layers", "2",
           "--reps", "1", "--check", causal]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "check: passed" in result.stdout, result.stdout[-3000:]
    assert "passed on to PyTorch's kernels" not in result.stdout, result.stdout[-3000:]
