"""scripts/sass_loops.py's pass through a loop body: the shortest and longest
paths over the body's forward branches, on a hand-made listing (no GPU, no
cuobjdump)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
sass_loops = pytest.importorskip("sass_loops", reason="needs the source tree (scripts/)")


def _listing(*texts):
    return [(16 * i, t) for i, t in enumerate(texts)]


def test_optional_block_and_exit():
    body = _listing(
        "FADD R0, R1, R2",
        "@!P0 BRA 0x1000",  # leaves the body (a barrier's retry): not taken
        "@P1 BRA 0x50",  # skips the optional block at 0x30-0x40
        "FMUL R3, R3, R4",
        "FMUL R5, R5, R4",
        "MUFU.EX2 R6, R7",
        "@P2 BRA 0x0",  # the loop's closing branch
    )
    short, long, walk = sass_loops.paths(body)
    assert (short, long) == (5, 7)
    assert [t.split()[0] for t in walk] == ["FADD", "@!P0", "@P1", "MUFU.EX2", "@P2"]


def test_if_else_and_inner_back_branch():
    body = _listing(
        "@P0 BRA 0x40",  # else branch at 0x40
        "FADD R0, R0, R1",  # then: three instructions
        "FADD R0, R0, R2",
        "BRA 0x50",  # unconditional: over the else
        "FMUL R0, R0, R1",  # else: one
        "@P3 BRA 0x10",  # an inner branch back: falls through
        "@P2 BRA 0x0",
    )
    short, long, walk = sass_loops.paths(body)
    assert (short, long) == (4, 6)
    assert "FMUL" in walk[1]
