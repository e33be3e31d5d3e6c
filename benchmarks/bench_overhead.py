"""Host microseconds per eager call: plain PyTorch beside the same call under enable().

    python benchmarks/bench_overhead.py            # CUDA when present, else CPU rows only
    python benchmarks/bench_overhead.py --calls 2000 --rounds 15
    python benchmarks/bench_overhead.py --profile    # also where enable()'s time goes (cProfile)

Rows:
  op          an ordinary op (x + 1 on a small tensor): what every op of a model pays
              for enable() being active
  sdpa served an SDPA call our kernels serve (prefill-like, L = 64), against
              PyTorch's own SDPA on the same call
  sdpa fallback  a call that falls back (one query token, as a decode step
              passes): PyTorch's SDPA plain and under enable()
  masked served  a speculative block (L = 4) with a boolean mask over a cache, as a
              static cache's step passes it: served on CUDA (the decode family)
  masked fallback  a prefill-like call (L = 64) with a boolean padding mask: falls back
  enter+exit  `with enable(): sdpa(...)` against the same served call inside
              an enable() held around the whole block: the cost of entering
              and leaving enable() around one call

The shapes are small, so that the GPU finishes each call before the host has
queued the next and the timings measure the host. Each row times its two
variants in turns (one block of --calls calls each per round) and prints the
median per call over --rounds rounds; "extra" is enable()'s minus plain's.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import torch_flash_backend as tfb


def per_call_us(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def compare(plain, routed, calls, rounds, sync):
    """Median µs per call of plain() and of routed(), timed in turns."""
    for fn in (plain, routed):  # warm-up: caches, first-call paths
        per_call_us(fn, max(10, calls // 10))
    sync()
    a, b = [], []
    for _ in range(rounds):
        a.append(per_call_us(plain, calls))
        sync()
        b.append(per_call_us(routed, calls))
        sync()
    return statistics.median(a), statistics.median(b)


def rows(device, calls, rounds):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(16, device=device)
    make = lambda h, length: torch.randn(1, length, h, 64, device=device, dtype=dtype).transpose(1, 2)
    q, k, v = make(8, 64), make(2, 64), make(2, 64)  # GQA, (B, L, H, E).transpose(1, 2), as HF passes
    q1, kc, vc = make(8, 1), make(2, 256), make(2, 256)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    decode = lambda: F.scaled_dot_product_attention(q1, kc, vc, enable_gqa=True)
    served = tfb.explain(q, k, v, is_causal=True, enable_gqa=True)
    fallback = tfb.explain(q1, kc, vc, enable_gqa=True)
    q4 = make(8, 4)
    cache_mask = (torch.arange(256, device=device) < 200).expand(1, 1, 4, 256)
    padding = torch.ones(1, 1, 64, 64, dtype=torch.bool, device=device)
    padding[..., 48:] = False
    masked = lambda: F.scaled_dot_product_attention(q4, kc, vc, attn_mask=cache_mask, enable_gqa=True)
    masked_long = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=padding, enable_gqa=True)

    def under_enable(fn):
        def run():
            with tfb.enable():
                for _ in range(calls):
                    fn()
        return run

    out = []
    for name, fn, note in (("op (x + 1)", lambda: x + 1, ""),
                           ("sdpa served", sdpa, str(served)),
                           ("sdpa fallback", decode, str(fallback)),
                           ("sdpa masked served", masked, str(tfb.explain(q4, kc, vc, attn_mask=cache_mask,
                                                                          enable_gqa=True))),
                           ("sdpa masked fallback", masked_long, str(tfb.explain(q, k, v, attn_mask=padding,
                                                                                 enable_gqa=True)))):
        # Under enable(): entered once around the whole block, so the row
        # measures the calls alone.
        plain = lambda fn=fn: [fn() for _ in range(calls)]
        a, b = compare(plain, under_enable(fn), 1, rounds, sync)
        out.append((device, name, a / calls, b / calls, note))

    def enter_exit():
        with tfb.enable():
            sdpa()
    a, b = compare(under_enable(sdpa), lambda: [enter_exit() for _ in range(calls)], 1, rounds, sync)
    out.append((device, "enter+exit around sdpa", a / calls, b / calls,
                "plain: the served call inside one enable() around the block"))
    return out, {"sdpa served": under_enable(sdpa), "sdpa fallback": under_enable(decode),
                 "sdpa masked served": under_enable(masked), "sdpa masked fallback": under_enable(masked_long),
                 "enter+exit around sdpa": lambda: [enter_exit() for _ in range(calls)]}


def profile(runs, top):
    """cProfile of each enable() variant: the functions with the most time of their own."""
    import cProfile
    import io
    import pstats

    for name, run in runs.items():
        run()  # warm
        prof = cProfile.Profile()
        prof.runcall(run)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        print(f"\n### {name} under enable(), by own time\n```\n{text.getvalue().strip()}\n```")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls per timed block")
    parser.add_argument("--rounds", type=int, default=11, help="timed blocks per variant (median)")
    parser.add_argument("--device", choices=["cuda", "cpu", "auto"], default="auto")
    parser.add_argument("--profile", action="store_true", help="cProfile each enable() variant after the table")
    args = parser.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        table, runs = rows(device, args.calls, args.rounds)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}")
    print("| device | call | plain µs | enable() µs | extra µs | ratio | note |")
    print("|---|---|---|---|---|---|---|")
    for device, name, a, b, note in table:
        print(f"| {device} | {name} | {a:.1f} | {b:.1f} | {b - a:+.1f} | {b / a:.2f} | {note} |")
    if args.profile:
        with torch.no_grad():
            profile(runs, 14)


if __name__ == "__main__":
    main()
