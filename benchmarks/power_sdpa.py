"""Board power and SM clock while one backend runs the forward back to back.

    python benchmarks/power_sdpa.py                 # E = 64 / 128 / 256, L = 16K, both masks
    python benchmarks/power_sdpa.py --head-dims 128 --seconds 5

Under sustained load an H100 sits at its power cap and lowers its clock, so a
kernel's sustained speed depends on its energy per FLOP as well as on how well it
keeps the tensor cores busy. For each shape and backend this runs the forward
for --seconds (after a warm-up of the same length, so every backend starts from
a card at its cap), samples power and clock with nvidia-smi every 100 ms, and
prints TFLOP/s, mean power, mean clock, TFLOP/s per kW and FLOP per clock cycle
per SM (how much each clock does: the clock-independent part of the speed).
Same shapes and inputs as bench_sdpa.py. A bf16 GEMM (8192 cubed, torch.mm) runs
first the same way: its TFLOP/s per kW, the tensor cores' work per joule with
little else running, is the yardstick for the attention forwards' on this card.
"""
import argparse
import subprocess
import time

import torch

from bench_sdpa import attention_flops, make_inputs, runner


def sample_while(fn, seconds):
    """Runs fn until `seconds` have passed; returns (calls, elapsed s, [(W, MHz)])."""
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE, text=True)
    torch.cuda.synchronize()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    smi.terminate()
    out, _ = smi.communicate()
    samples = []
    for line in out.splitlines():
        try:
            watts, mhz = (float(x) for x in line.split(","))
        except ValueError:
            continue
        samples.append((watts, mhz))
    return calls, elapsed, samples


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--len", type=int, default=16384)
    p.add_argument("--causal", default="0,1")
    p.add_argument("--backends", default="ours,cudnn,flash")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--no-gemm", action="store_true", help="leave out the GEMM row")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}, bf16, B*L = 16384, hidden 2048, forward, {args.seconds:g} s per backend\n")
    print("| causal | E | L | backend | TFLOP/s | W | MHz | TFLOP/s per kW | FLOP/clk/SM |")
    print("|---|---|---|---|---|---|---|---|---|")

    def report(causal, e, l, backend, flops, run):
        sample_while(run, args.seconds)  # warm-up: reach the power cap
        calls, elapsed, samples = sample_while(run, args.seconds)
        tflops = flops * calls / elapsed / 1e12
        watts = sum(s[0] for s in samples) / max(len(samples), 1)
        mhz = sum(s[1] for s in samples) / max(len(samples), 1)
        per_clk = flops * calls / elapsed / (mhz * 1e6) / sms
        print(f"| {causal} | {e} | {l} | {backend} | {tflops:.0f} | {watts:.0f} | {mhz:.0f} | "
              f"{tflops / watts * 1000:.0f} | {per_clk:.0f} |", flush=True)

    if not args.no_gemm:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        report("-", "-", "-", f"GEMM {n}^3", 2 * n**3, lambda: torch.mm(a, b))
        del a, b
    for e in (int(x) for x in args.head_dims.split(",")):
        for causal in (bool(int(x)) for x in args.causal.split(",")):
            h, l = 2048 // e, args.len
            b = max(16384 // l, 1)
            q, k, v = make_inputs(b, h, l, e, torch.bfloat16, False)
            flops = attention_flops(b, h, l, l, e, causal, "fwd")
            for backend in args.backends.split(","):
                report(int(causal), e, l, backend, flops, runner(backend, q, k, v, causal, "fwd"))


if __name__ == "__main__":
    main()
