"""The mask policies of src/common/mask.h, which every kernel family and the
CPU ops take their masking from, against their definitions: a C++ program
(test/cpp/mask_policy_check.cpp) compiled with the host compiler checks
visibility and every tile walk by brute force over small shapes."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_mask_policies_agree_with_their_definitions(tmp_path):
    exe = tmp_path / "mask_policy_check"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-I", os.path.join(ROOT, "src"),
                    os.path.join(ROOT, "test", "cpp", "mask_policy_check.cpp"), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
