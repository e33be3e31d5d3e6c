"""Prints markdown tables of the last setup.py build's compile times: every
source, the totals per family (each family's instantiations; "binding" for
csrc/, "shared" for the other sources under src/) and the build's wall time.

    python scripts/compile_times.py [BUILD_DIR]   # default: build/
    python scripts/compile_times.py --top 10      # the ten slowest files only

Times come from ninja's logs (build/temp*/.ninja_log and the per-family ones
below it): the latest compile of each file, in wall seconds. With MAX_JOBS > 1
the jobs share the CPU, so a file's time depends on what compiled beside it;
the wall time is from the first compile's start to the last one's end, and
counts each log's own clock (the family steps run one after another).
"""
import argparse
import glob
import os
import re
import sys

INSTANTIATION = re.compile(r"/src/(\w+)/instantiations/(fwd|bwd)(?:_[a-z0-9]+)?_hdim\d+_\w+\.o$")  # fwd_fp8_hdim64_128_sm90 too
OBJECT = re.compile(r"/build/temp[^/]*/(?:\w+/)?((?:src|csrc)/.*)\.o$")


def latest_times(build_dir: str) -> tuple[dict[str, tuple[str, float]], float]:
    """({source: (family, seconds)} from the newest log entry of each, wall seconds)."""
    logs = glob.glob(os.path.join(build_dir, "temp*", ".ninja_log"))
    logs += glob.glob(os.path.join(build_dir, "temp*", "*", ".ninja_log"))
    times, wall = {}, 0.0
    for log in sorted(logs, key=os.path.getmtime):  # a newer log, and a later line, wins
        spans = {}
        with open(log) as f:
            for line in f:
                fields = line.rstrip("\n").split("\t")
                if line.startswith("#") or len(fields) < 4:
                    continue
                obj = OBJECT.search(fields[3])
                if not obj:
                    continue
                source = obj.group(1)
                inst = INSTANTIATION.search(fields[3])
                family = inst.group(1) if inst else "binding" if source.startswith("csrc/") else "shared"
                start, end = int(fields[0]), int(fields[1])
                times[source] = (family, (end - start) / 1000)
                spans[source] = (start, end)
        if spans:  # the latest build's entries of this log
            wall += (max(e for _, e in spans.values()) - min(s for s, _ in spans.values())) / 1000
    return times, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build_dir", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", "build"))
    parser.add_argument("--top", type=int, default=0, help="list only the N slowest files")
    args = parser.parse_args()

    times, wall = latest_times(args.build_dir)
    if not times:
        print(f"no compiled sources in the ninja logs under {args.build_dir}; build with setup.py first",
              file=sys.stderr)
        return 1
    rows = sorted(((family, source, seconds) for source, (family, seconds) in times.items()),
                  key=lambda r: -r[2] if args.top else (r[0], r[1]))
    print("| file | family | seconds |")
    print("|---|---|---:|")
    for family, source, seconds in rows[:args.top or None]:
        print(f"| {source} | {family} | {seconds:.1f} |")
    print()
    print("| family | files | seconds | slowest |")
    print("|---|---:|---:|---:|")
    for family in sorted({r[0] for r in rows}):
        mine = [s for f, _, s in rows if f == family]
        print(f"| {family} | {len(mine)} | {sum(mine):.0f} | {max(mine):.0f} |")
    total = sum(s for *_, s in rows)
    print(f"| **all** | {len(rows)} | **{total:.0f}** | |")
    print(f"\nwall time of the compile steps: {wall / 60:.1f} min ({total / 60:.1f} min of compiling)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
