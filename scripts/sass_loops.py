"""The loops of the kernels in a built op library (or an object file): each
backward branch whose body holds tensor-core instructions, with the body's
instruction count and its most frequent opcodes.

    python scripts/sass_loops.py torch_flash_backend/lib/libtorch_flash_backend.so --kernel split_kernel
    python scripts/sass_loops.py build/temp/src/decode/instantiations/fwd_hdim128_decode.o --arch sm_90

Counts are static: a branch inside the body (a partial tile's path beside a
whole one's) counts both sides. --paths adds what one iteration issues: the
shortest and the longest path through the body's forward branches (usually a
whole tile's with every optional block skipped, and a masked tile's with all
of them), with the shortest path's mix; a branch that leaves the body (a
barrier's retry, the loop's exit) counts as not taken.

cuobjdump needs nvdisasm beside it; on a machine without the CUDA
toolkit's binaries both come from pip (`pip download nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`, their wheels hold nvidia/cu13/bin/).
"""
import argparse
import collections
import re
import shutil
import subprocess
import sys

FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
ARCH = re.compile(r"^\s*arch\s*=\s*(\S+)")
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")
MMA = ("HMMA", "HGMMA", "QGMMA", "IMMA")


def kernels(cuobjdump: str, binary: str) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """(arch, mangled name) -> [(address, instruction)]."""
    text = subprocess.run([cuobjdump, "-sass", binary], check=True, capture_output=True, text=True).stdout
    out: dict[tuple[str, str], list[tuple[int, str]]] = collections.defaultdict(list)
    arch, name = "?", None
    for line in text.splitlines():
        if m := ARCH.match(line):
            arch = m.group(1)
        elif m := FUNCTION.match(line):
            name = (arch, m.group(1))
        elif name and (m := INSTRUCTION.match(line)):
            out[name].append((int(m.group(1), 16), m.group(2)))
    return out


def loops(instructions: list[tuple[int, str]]):
    """(first address, branch address, body as (address, instruction)) of each
    backward branch whose body holds an MMA."""
    index = {address: i for i, (address, _) in enumerate(instructions)}
    for i, (address, text) in enumerate(instructions):
        m = BRANCH.search(text)
        target = int(m.group(1), 16) if m else None
        if target is None or target >= address or target not in index:
            continue
        body = instructions[index[target]:i + 1]
        if any(t.split()[0].split(".")[0] in MMA for t in (PREDICATE.sub("", b) for _, b in body) if t):
            yield target, address, body


def paths(body: list[tuple[int, str]]):
    """(shortest, longest) instruction counts of one pass from the body's first
    instruction to its closing branch, over its forward branches, and the
    shortest path's instructions."""
    position = {address: i for i, (address, _) in enumerate(body)}
    n = len(body)
    shortest, longest, step = [1] * n, [1] * n, [None] * n
    for i in range(n - 2, -1, -1):
        text = body[i][1]
        m = BRANCH.search(text)
        target = position.get(int(m.group(1), 16)) if m else None
        if m and target is not None and target > i:
            successors = [target] + ([i + 1] if PREDICATE.match(text) else [])
        else:
            successors = [i + 1]  # no branch, or one leaving the body or going back: fall through
        step[i] = min(successors, key=lambda j: shortest[j])
        shortest[i] = 1 + shortest[step[i]]
        longest[i] = 1 + max(longest[j] for j in successors)
    walk, i = [], 0
    while i is not None:
        walk.append(body[i][1])
        i = step[i]
    return shortest[0], longest[0], walk


def mix_of(texts, top):
    ops = collections.Counter(PREDICATE.sub("", t).split()[0].split(".")[0] for t in texts if t)
    return ", ".join(f"{op} {n}" for op, n in ops.most_common(top))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("binary")
    parser.add_argument("--kernel", default="", help="only kernels whose mangled name holds this")
    parser.add_argument("--arch", default="", help="only this architecture (e.g. sm_90)")
    parser.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    parser.add_argument("--paths", action="store_true", help="also the shortest and longest pass through each loop")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump")
    args = parser.parse_args()
    found = 0
    for (arch, name), instructions in sorted(kernels(args.cuobjdump, args.binary).items()):
        if args.kernel not in name or (args.arch and arch != args.arch):
            continue
        for first, last, body in loops(instructions):
            found += 1
            mix = mix_of([t for _, t in body], args.top)
            print(f"{arch} {name[:100]}\n  loop {first:#x}-{last:#x}: {len(body)} instructions; {mix}")
            if args.paths:
                short, long, walk = paths(body)
                print(f"    a pass: {short} to {long} instructions; the shortest: {mix_of(walk, args.top)}")
    if not found:
        print("no loop with tensor-core instructions in the kernels selected", file=sys.stderr)
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
