"""The op library is bound to the torch release it was built against: the
package refuses to load it beside another one, with a message naming both."""
import os
import subprocess

import pytest

from torch_flash_backend._library import REBUILD, release, torch_mismatch


def test_release():
    assert release("2.11.0+cu130") == "2.11"
    assert release("2.13.0") == "2.13"
    assert release("2.12.0a0+git1234") == "2.12"


@pytest.mark.parametrize("installed, cuda", [("2.11.0+cu130", "13.0"), ("2.11.1+cu130", "13.2"), ("2.11.0", "13.0")])
def test_same_release_loads(installed, cuda):
    assert torch_mismatch("2.11.0+cu130", "13.0", installed, cuda) is None


def test_cpu_build_loads_beside_cuda_torch_of_its_release():
    assert torch_mismatch("2.11.0+cpu", None, "2.11.0+cu130", "13.0") is None


def test_other_release_names_both_and_the_fix():
    why = torch_mismatch("2.11.0+cu130", "13.0", "2.13.0+cpu", None)
    assert "built for torch 2.11.* (2.11.0+cu130)" in why
    assert "torch 2.13.0+cpu (no CUDA) is installed" in why
    assert "torch==2.11.*" in why and REBUILD in why


@pytest.mark.parametrize("installed, cuda", [("2.11.0+cpu", None), ("2.11.0+cu126", "12.6")])
def test_cuda_build_beside_other_cuda(installed, cuda):
    why = torch_mismatch("2.11.0+cu130", "13.0", installed, cuda)
    assert "torch 2.11.0+cu130 (CUDA 13.0)" in why and f"torch {installed}" in why


# .ci/run installs the wheel (with --no-deps) into a venv that has another torch
# release and points this at its python.
OTHER = os.environ.get("TFB_OTHER_TORCH_PYTHON")


@pytest.mark.skipif(not OTHER, reason="TFB_OTHER_TORCH_PYTHON (a python with the wheel beside another torch) not set")
def test_installed_wheel_beside_other_torch(tmp_path):
    def run(code):
        return subprocess.run([OTHER, "-c", code], cwd=tmp_path, capture_output=True, text=True)

    other = run("import torch; print(torch.__version__)").stdout.strip()
    requires = run("import importlib.metadata as m; print(m.requires('torch_flash_backend'))").stdout
    import torch

    assert f"torch=={release(torch.__version__)}.*" in requires, requires
    assert release(other) != release(torch.__version__), other
    failed = run("import torch_flash_backend")
    assert failed.returncode != 0
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: torch_flash_backend cannot load"), failed.stderr
    assert f"torch {other}" in last and torch.__version__ in last and "rebuild" in last, last
