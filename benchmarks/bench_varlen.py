"""Packed variable-length attention (varlen_attn's calls) in TFLOP/s: PyTorch's
own kernel (varlen_attn), ours (the packed op, families as the router pins
them, as enable() and the provider's served calls run), FlashAttention-4's
varlen path where installed (flash_attn.cute), and, for
batches of equal lengths, our dense kernel on the same tokens. Backends in
turns, one table.

    python benchmarks/bench_varlen.py [--total 16384,65536] [--batches uniform,long,equal]
        [--head-dim 128] [--heads 16] [--causal 0,1] [--modes fwd,fwdbwd] [--window 4096]

--window W adds a table of our causal sliding window (W, 0) against our causal
call on the same batch: the window's time over the causal time scaled by the
fraction of pairs the window keeps (1.0: the band costs exactly what it keeps).

Batches: "uniform" lengths uniform in [1, 4096]; "long" one document of 32K
tokens (half the batch when the total is smaller) among documents of 100-500;
"equal" documents of 2048. FLOPs count each sequence alone: 4 L^2 E H for the
forward (halved when causal), 2.5 times that more for the backward.
"""
import argparse

import torch
from torch.nn.attention.varlen import varlen_attn

import torch_flash_backend as tfb
from torch_flash_backend import _router
from bench_sdpa import fa4

ops = torch.ops.torch_flash_backend


def lengths(kind: str, total: int, gen: torch.Generator) -> list[int]:
    if kind == "equal":
        return [2048] * max(1, total // 2048)
    lens = [min(32768, total // 2)] if kind == "long" else []
    low, high = (100, 500) if kind == "long" else (1, 4096)
    while sum(lens) < total:
        lens.append(int(torch.randint(low, high + 1, (1,), generator=gen)))
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n > 0]


def timed(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e-3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--total", default="16384,65536")
    parser.add_argument("--batches", default="uniform,long,equal")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=int, default=0)
    args = parser.parse_args()
    e, h = args.head_dim, args.heads
    flash4 = fa4("flash_attn_varlen_func")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, E {e}, {h} heads; TFLOP/s "
          f"(best of {args.rounds} rounds in turns); FA4: {'flash_attn.cute' if flash4 else 'not installed'}")
    print("| batch | tokens | seqs | longest | causal | mode | PyTorch | ours | ours dense | FA4 | ours / PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    windows = []
    for total in map(int, args.total.split(",")):
        for kind in args.batches.split(","):
            lens = lengths(kind, total, gen)
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
            tokens, longest = sum(lens), max(lens)
            q, k, v = (torch.randn(tokens, h, e, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn(tokens, h, e, device="cuda", dtype=torch.bfloat16)
            for causal in map(int, args.causal.split(",")):
                window = (-1, 0) if causal else (-1, -1)
                per_seq = sum(4 * n * n * e * h for n in lens) / (2 if causal else 1)
                for mode in args.modes.split(","):
                    flops = per_seq * (3.5 if mode == "fwdbwd" else 1.0)

                    def step(out_fn, grad=dout):
                        if mode == "fwd":
                            with torch.no_grad():
                                out_fn()
                        else:
                            torch.autograd.grad(out_fn(), (q, k, v), grad)

                    def pytorch():
                        step(lambda: varlen_attn(q, k, v, cu, cu, longest, longest, window_size=window))

                    # Ours: the packed op with the families the router pins (enable()'s, where
                    # the chip's first family reads packed batches).
                    pinned = _router.decide_varlen(q, k, v, cu, cu, longest, longest, 0.0, bool(causal),
                                                   needs_grad=mode == "fwdbwd", pinned=True)

                    def ours():
                        step(lambda: ops.varlen_fwd(q, k, v, cu, cu, longest, longest, None, bool(causal),
                                                    pinned.family, pinned.backward_family)[0])

                    runs = {"PyTorch": pytorch, "ours": ours}
                    if kind == "equal":
                        b = len(lens)
                        dense = [t.view(b, longest, h, e).transpose(1, 2) for t in (q, k, v)]

                        dense_grad = dout.view(b, longest, h, e).transpose(1, 2)

                        def ours_dense():
                            step(lambda: tfb.flash_attn(*dense, is_causal=bool(causal)), dense_grad)
                        runs["ours dense"] = ours_dense
                    if flash4 is not None:
                        def fa4_run():
                            step(lambda: flash4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                                max_seqlen_k=longest, causal=bool(causal))[0])
                        runs["FA4"] = fa4_run
                    best = {}
                    for _ in range(args.rounds):
                        for name, fn in runs.items():
                            best[name] = max(best.get(name, 0.0), flops / timed(fn, args.reps, args.warmup) / 1e12)
                    cells = [f"{best[n]:.0f}" if n in best else "-" for n in ("PyTorch", "ours", "ours dense", "FA4")]
                    print(f"| {kind} | {tokens} | {len(lens)} | {longest} | {causal} | {mode} | {' | '.join(cells)} | "
                          f"{best['ours'] / best['PyTorch']:.2f} |", flush=True)
                    if args.window and causal:
                        w = args.window

                        def banded():
                            step(lambda: ops.varlen_fwd(q, k, v, cu, cu, longest, longest, None, True,
                                                        pinned.family, pinned.backward_family, w, 0)[0])
                        times = {}
                        for _ in range(args.rounds):
                            for name, fn in (("causal", ours), ("window", banded)):
                                times[name] = min(times.get(name, 1e9), timed(fn, args.reps, args.warmup))
                        kept = sum(n * (n + 1) // 2 if n <= w + 1 else (w + 1) * (w + 2) // 2 + (n - w - 1) * (w + 1)
                                   for n in lens) / sum(n * (n + 1) // 2 for n in lens)
                        windows.append(f"| {kind} | {tokens} | {mode} | {times['causal'] * 1e3:.2f} | "
                                       f"{times['window'] * 1e3:.2f} | {kept:.3f} | "
                                       f"{times['window'] / (times['causal'] * kept):.2f} |")
    if windows:
        print(f"\n| batch | tokens | mode | causal ms | window ({args.window}, 0) ms | pairs kept | "
              "window / (causal x kept) |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(windows))


if __name__ == "__main__":
    main()
