"""Compares the machine code of every kernel in two builds of the op library.

    python scripts/sass_diff.py OLD.so NEW.so [--cuobjdump PATH]

Prints a table: each kernel (by its mangled name, per architecture) marked
same, changed (with both instruction counts) or only in one build. A change
that leaves a kernel's SASS the same cannot change its speed or results, so
an A/B run is needed only for the changed rows. Instructions are compared
without their addresses and encodings (those shift with code placed before).
"""
import argparse
import collections
import re
import shutil
import subprocess
import sys

FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
ARCH = re.compile(r"^\s*arch\s*=\s*(\S+)")
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")
# An anonymous namespace's mangled name carries hashes of its file's path:
# _GLOBAL__N__<hash>_<len>_<file>_<hash>. Two builds in two folders differ there alone.
ANONYMOUS = re.compile(r"_GLOBAL__N__[0-9a-f]+_(\d+_\w+?)_[0-9a-f]{8}(?=\d)")


def kernels(cuobjdump: str, library: str) -> dict[tuple[str, str], list[str]]:
    """(arch, mangled name) -> its instructions."""
    text = subprocess.run([cuobjdump, "-sass", library], check=True, capture_output=True, text=True).stdout
    out: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    arch, name = "?", None
    for line in text.splitlines():
        if m := ARCH.match(line):
            arch = m.group(1)
        elif m := FUNCTION.match(line):
            name = (arch, ANONYMOUS.sub(r"_GLOBAL__N__\1", m.group(1)))
            out[name]  # a kernel with no instructions still counts
        elif name and (m := INSTRUCTION.match(line)):
            out[name].append(m.group(1))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump")
    args = parser.parse_args()
    old, new = kernels(args.cuobjdump, args.old), kernels(args.cuobjdump, args.new)
    rows = collections.Counter()
    print("| arch | kernel | old | new | |")
    print("|---|---|---:|---:|---|")
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        verdict = "only new" if a is None else "only old" if b is None else "same" if a == b else "changed"
        rows[verdict] += 1
        if verdict != "same":
            print(f"| {key[0]} | {key[1][:110]} | {len(a or [])} | {len(b or [])} | {verdict} |")
    print(f"| | **{rows['same']} kernels the same** | | | |")
    print(", ".join(f"{n} {v}" for v, n in sorted(rows.items())))
    return 0 if set(rows) <= {"same"} else 1


if __name__ == "__main__":
    sys.exit(main())
