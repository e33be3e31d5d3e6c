"""benchmarks/ab_table.py: ab_libs.sh's rows, grouped per call, each library's best against
the first's (higher TFLOP/s, or lower times with --lower)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
ab_table = pytest.importorskip("ab_table", reason="needs the source tree (benchmarks/)")

ROWS = """\
/tmp/ab/old/lib.so r1 | fwdbwd | 0 | 128 | 4096 | 4 | 16 | 500 |
/tmp/ab/new/lib.so r1 | fwdbwd | 0 | 128 | 4096 | 4 | 16 | 520 |
/tmp/ab/old/lib.so r2 | fwdbwd | 0 | 128 | 4096 | 4 | 16 | 510 |
/tmp/ab/new/lib.so r2 | fwdbwd | 0 | 128 | 4096 | 4 | 16 | 505 |
(no rows: /tmp/ab/new/lib.so)
/tmp/ab/old/lib.so r1 | fwdbwd | 1 | 128 | 4096 | 4 | 16 | 400 |
""".splitlines()


def test_groups_rounds_per_call_and_compares_bests():
    calls, libraries = ab_table.parse(ROWS, -1)
    assert libraries == ["old", "new"]
    assert calls[("fwdbwd", "0", "128", "4096", "4", "16")] == {"old": [500.0, 510.0], "new": [520.0, 505.0]}
    lines = ab_table.table(calls, libraries, names=["mode", "causal"])
    assert lines[0].startswith("| mode | causal | cell 2 |") and lines[0].endswith("| old | new | new/old |")
    assert lines[2].endswith("| 500/510 | 520/505 | 1.020 |")  # 520 / 510
    assert lines[3].endswith("| 400 | - | - |")  # a library without the call


def test_times_and_chosen_key_cells():
    rows = ["a/x.so r1 | fwdbwd | padding | 2.4 | 9 |", "b/x.so r1 | fwdbwd | padding | 1.6 | 7 |",
            "a/x.so r2 | fwdbwd | padding | 2.0 | 8 |"]
    calls, libraries = ab_table.parse(rows, 2, key_cells=[0, 1])
    lines = ab_table.table(calls, libraries, lower=True)
    assert lines[2] == "| fwdbwd | padding | 2.4/2 | 1.6 | 1.250 |"  # 2.0 / 1.6: b is faster
