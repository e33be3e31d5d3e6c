"""The table of an A/B run: benchmarks/ab_libs.sh's rows (each prefixed with its library and
round) as one markdown row per call, every library's values in its rounds, and each library's
best against the first library's best (> 1: faster, for times too with --lower).

    ROUNDS=2 bash benchmarks/ab_libs.sh "..." a/lib.so b/lib.so > ab.txt
    python benchmarks/ab_table.py ab.txt                       # bench_sdpa.py rows: the last cell, TFLOP/s
    python benchmarks/ab_table.py ab.txt --names mode,causal,E,L,B,H
    python benchmarks/ab_table.py ab.txt --column 4 --lower    # bench_masks.py rows: ours' milliseconds
    python benchmarks/ab_table.py ab.txt --column 7 --key 0,1,2,3,4,5   # bench_varlen.py: ours' TFLOP/s

A library is named by its file's folder (a/lib.so: "a"). --column: the index of the value among
a row's cells (negative from the end); the cells before it name the call, or those --key lists
(where other backends' values sit between, which vary from run to run).
"""
import argparse
import math
import re
import sys

ROW = re.compile(r"^(\S+) r(\d+) \|(.*)\|\s*$")


def parse(lines, column, key_cells=None):
    """{call: {library: [values in round order]}} and the libraries in first-seen order."""
    calls, libraries = {}, []
    for line in lines:
        m = ROW.match(line.rstrip("\n"))
        if not m:
            continue
        path, cells = m.group(1), [c.strip() for c in m.group(3).split("|")]
        library = path.rstrip("/").split("/")[-2] if "/" in path else path
        try:
            value = float(cells[column])
        except (ValueError, IndexError):
            continue
        if math.isnan(value):
            continue
        key = tuple(cells[i] for i in key_cells) if key_cells else tuple(cells[:column % len(cells)])
        if library not in libraries:
            libraries.append(library)
        calls.setdefault(key, {}).setdefault(library, []).append(value)
    return calls, libraries


def table(calls, libraries, lower=False, names=()):
    """Markdown lines: the call's cells, each library's values, each later library's best / the first's."""
    base = libraries[0]
    width = max(len(k) for k in calls)
    names = list(names)[:width] + [f"cell {i}" for i in range(len(names), width)]
    head = names + libraries + [f"{lib}/{base}" for lib in libraries[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best = min if lower else max
    for key, values in calls.items():
        cells = list(key) + [""] * (width - len(key))
        cells += ["/".join(f"{v:g}" for v in values.get(lib, [])) or "-" for lib in libraries]
        for lib in libraries[1:]:
            if base in values and lib in values:
                a, b = best(values[base]), best(values[lib])
                cells.append(f"{(a / b if lower else b / a):.3f}")
            else:
                cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file", nargs="?", help="ab_libs.sh's output (default: stdin)")
    parser.add_argument("--column", type=int, default=-1)
    parser.add_argument("--lower", action="store_true", help="values are times: lower is better")
    parser.add_argument("--key", default="", help="comma-separated indices of the cells that name a call")
    parser.add_argument("--names", default="", help="comma-separated names of the cells that name a call")
    args = parser.parse_args()
    lines = open(args.file).readlines() if args.file else sys.stdin.readlines()
    calls, libraries = parse(lines, args.column, [int(i) for i in args.key.split(",") if i])
    if not calls:
        sys.exit(f"no rows of ab_libs.sh with a number in cell {args.column}")
    print("\n".join(table(calls, libraries, args.lower, [n for n in args.names.split(",") if n])))


if __name__ == "__main__":
    main()
