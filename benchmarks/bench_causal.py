"""Bottom-right causal attention (a query chunk after a cache: L < S), ours beside PyTorch.

    python benchmarks/bench_causal.py
    python benchmarks/bench_causal.py --shapes 2048x16384 --modes fwd

bf16, E = 128, 32 query heads over 8 kv heads (GQA), q/k/v as (B, L, H, E).transpose(1, 2),
attn_mask=torch.nn.attention.bias.causal_lower_right(L, S). Columns: milliseconds of ours
(flash_attn on the call: the ops' bottom_right=True), PyTorch's SDPA on the same call
(CausalBias picks its flash kernel where it can, else the efficient one), ours on the
square causal call of S rows scaled to L rows' share of its pairs (what the chunk would
cost at the square call's rate), and PyTorch/ours. TFLOP/s count the visible pairs.
Backends take turns, one timed call each per round (bench_sdpa.py's time_in_turns),
medians of CUDA-event times.
"""
import argparse
import contextlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from bench_sdpa import as_run, make_inputs, time_in_turns

HEADS, GROUP, E = 32, 4, 128


def visible_pairs(length, s):
    """(row, key) pairs a bottom-right causal mask keeps: row i sees min(S, i + S - L + 1) keys."""
    return sum(max(0, min(s, i + s - length + 1)) for i in range(length))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="512x8192,2048x8192,2048x16384,8192x16384", help="LxS, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_causal.py needs a CUDA GPU")
    import torch_flash_backend as tfb

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, E {E}, "
          f"{HEADS}:{HEADS // GROUP} heads, B {args.batch}, ms per call (TFLOP/s)\n")
    print("| mode | L | S | ours | PyTorch | ours, square causal S x S, scaled | PyTorch/ours |")
    print("|---|---|---|---|---|---|---|")
    notes = []
    for mode in args.modes.split(","):
        for shape in args.shapes.split(","):
            length, s = (int(x) for x in shape.split("x"))
            b = args.batch
            q, _, _ = make_inputs(b, HEADS, length, E, torch.bfloat16, mode == "fwdbwd", GROUP)
            qs, k, v = make_inputs(b, HEADS, s, E, torch.bfloat16, mode == "fwdbwd", GROUP)
            bias = causal_lower_right(length, s)
            if mode == "fwd":
                notes.append(f"L {length}, S {s}: {tfb.explain(q, k, v, attn_mask=bias, enable_gqa=True)}")
            runs = {
                "ours": (contextlib.nullcontext,
                         as_run(lambda: tfb.flash_attn(q, k, v, attn_mask=bias, enable_gqa=True), q, k, v, mode)),
                "pytorch": (contextlib.nullcontext,
                            as_run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True),
                                   q, k, v, mode)),
                "square": (contextlib.nullcontext,
                           as_run(lambda: tfb.flash_attn(qs, k, v, is_causal=True, enable_gqa=True), qs, k, v, mode)),
            }
            ms = time_in_turns(runs, args.warmup, args.reps)
            pairs = visible_pairs(length, s)
            flops = 4 * b * HEADS * pairs * E * (3.5 if mode == "fwdbwd" else 1.0)

            def cell(t):
                return "-" if isinstance(t, RuntimeError) else f"{t:.3f} ({flops / t / 1e9:.0f})"
            square = ms["square"] * pairs / visible_pairs(s, s)
            ratio = ms["pytorch"] / ms["ours"] if not isinstance(ms["pytorch"], RuntimeError) else float("nan")
            print(f"| {mode} | {length} | {s} | {cell(ms['ours'])} | {cell(ms['pytorch'])} | {square:.3f} | "
                  f"{ratio:.2f} |")
            del q, qs, k, v
    print()
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
