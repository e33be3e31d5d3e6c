"""Calls of ours on one of bench_masks.py's masked shapes (or the same call unmasked), for a profiler:

    ncu -k regex:bwd_kernel --launch-skip 2 --launch-count 1 python3 benchmarks/mask_calls.py --mask keep-all
    ncu -k regex:bwd_kernel --launch-skip 2 --launch-count 1 python3 benchmarks/mask_calls.py --mask keep-all --plain

Each call is a forward and, with --mode fwdbwd (the default), its backward.
"""
import argparse

import torch

from bench_masks import E, HEADS, MASKS, make_mask, runner
from bench_sdpa import make_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mask", choices=sorted(MASKS), default="keep-all")
    parser.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd")
    parser.add_argument("--plain", action="store_true", help="the same call without the mask (bench_masks' ours-plain)")
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    b, length = MASKS[args.mask]
    q, k, v = make_inputs(b, HEADS, length, E, torch.bfloat16, args.mode == "fwdbwd")
    run = runner("ours-plain" if args.plain else "ours", q, k, v, make_mask(args.mask, b, length), args.mask,
                 args.mode)
    for _ in range(args.calls):
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
