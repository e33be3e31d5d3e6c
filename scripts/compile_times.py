"""Prints a markdown table of the compile time of every kernel instantiation in
the last setup.py build, sm90 first, with totals per family.

    python scripts/compile_times.py [BUILD_DIR]   # default: build/

Times come from ninja's logs (build/temp*/.ninja_log and the sm90 one below
it): the latest compile of each file, in wall seconds. With MAX_JOBS > 1 the
jobs share the CPU, so a file's time depends on what compiled beside it.
"""
import argparse
import glob
import os
import re
import sys

OBJECT = re.compile(r"/src/(sm\d+)/instantiations/((fwd|bwd)_hdim(\d+)_(fp16|bf16)_sm\d+)\.o$")


def latest_times(build_dir: str) -> dict[tuple, float]:
    """Seconds per instantiation, keyed (sort key, family, name), from the newest log entry."""
    logs = glob.glob(os.path.join(build_dir, "temp*", ".ninja_log"))
    logs += glob.glob(os.path.join(build_dir, "temp*", "*", ".ninja_log"))
    times = {}
    for log in sorted(logs, key=os.path.getmtime):  # a newer log, and a later line, wins
        with open(log) as f:
            for line in f:
                fields = line.rstrip("\n").split("\t")
                m = OBJECT.search(fields[3]) if len(fields) >= 4 and not line.startswith("#") else None
                if m:
                    family, name, pass_, head_dim, dtype = m.groups()
                    key = ((family != "sm90", family, pass_, int(head_dim), dtype), family, name)
                    times[key] = (int(fields[1]) - int(fields[0])) / 1000
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build_dir", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", "build"))
    args = parser.parse_args()

    rows = sorted((*key, seconds) for key, seconds in latest_times(args.build_dir).items())
    if not rows:
        print(f"no kernel instantiations in the ninja logs under {args.build_dir}; build with setup.py first",
              file=sys.stderr)
        return 1
    print("| file | seconds |")
    print("|---|---:|")
    for _, family, name, seconds in rows:
        print(f"| {family}/{name}.cu | {seconds:.1f} |")
    for family in dict.fromkeys(family for _, family, _, _ in rows):  # in row order
        times = [seconds for _, f, _, seconds in rows if f == family]
        print(f"| **{family} total** ({len(times)} files) | **{sum(times):.1f}** |")
    print(f"| **all** ({len(rows)} files) | **{sum(seconds for *_, seconds in rows):.1f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
