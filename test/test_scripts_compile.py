"""The benchmarks and scripts run on the GPU machine only, where a mistake costs a
device call: each must at least compile here (a SyntaxError, such as a name used
before its `global` declaration, is found by compiling, not by parsing alone),
and each benchmark must answer --help without a GPU.
"""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")) + glob.glob(os.path.join(ROOT, "scripts", "*.py")))

pytestmark = pytest.mark.skipif(not SCRIPTS, reason="needs the source tree (benchmarks/, scripts/)")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_compiles(path):
    with open(path, encoding="utf-8") as f:
        compile(f.read(), path, "exec")


# The benchmarks with an argparse front end and no work at import time.
HELP = ["bench_masks.py", "bench_sdpa.py", "bench_decode.py", "bench_overhead.py", "bench_model.py"]


@pytest.mark.parametrize("name", HELP)
def test_help(name):
    path = os.path.join(ROOT, "benchmarks", name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.join(ROOT, "benchmarks"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout
