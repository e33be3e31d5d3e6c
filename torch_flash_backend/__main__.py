"""python -m torch_flash_backend: a small transformer block, run as PyTorch runs it
and again under tfb.enable(), with the routing decision of every attention call,
the largest difference between the two outputs, time and peak memory.

The block is written as Hugging Face models write attention (q as
(B, L, H, E).transpose(1, 2), fewer K/V heads with enable_gqa=True,
is_causal=True) and knows nothing of this package.
"""
import argparse
import logging
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_flash_backend as tfb


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x):
        b, l, _ = x.shape
        q = self.q_proj(x).view(b, l, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, l, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, l, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, l, -1))


class Block(nn.Module):
    def __init__(self, hidden, heads, kv_heads):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.attn = Attention(hidden, heads, kv_heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DecisionLog(logging.Handler):
    """Collects the router's per-call DEBUG lines."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def measure(fn, device, reps):
    """(median seconds, peak bytes allocated or None) of fn()."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return statistics.median(times), peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    # A model size that fills a GPU a little; on a CPU, one that finishes in seconds.
    batch, length, hidden, heads, kv_heads = (4, 2048, 2048, 16, 4) if on_gpu else (2, 256, 256, 4, 2)
    dtype = torch.bfloat16 if on_gpu else torch.float32

    print(f"torch {torch.__version__}, torch_flash_backend {tfb.__version__}")
    if on_gpu:
        cap = torch.cuda.get_device_capability(device)
        print(f"GPU: {torch.cuda.get_device_name(device)}, compute capability {cap[0]}.{cap[1]}")
    else:
        why = "no CUDA GPU is visible" if not torch.cuda.is_available() else f"--device {args.device}"
        print(f"running on CPU ({why}): every SDPA call falls back to PyTorch, and the reasons say so")
    kernels = tfb.built_kernels()
    print(f"kernels built: {', '.join(kernels) if kernels else 'none (CPU-only build)'}")
    print(f"block: batch {batch}, length {length}, hidden {hidden}, heads {heads}/{kv_heads} (q/kv), {dtype}\n")

    torch.manual_seed(0)
    model = Block(hidden, heads, kv_heads).to(device, dtype)
    x = torch.randn(batch, length, hidden, device=device, dtype=dtype)
    decode_x = torch.randn(batch, 1, hidden, device=device, dtype=dtype)

    def prefill():
        with torch.no_grad():
            return model(x)

    def train_step():
        model.zero_grad(set_to_none=True)
        y = model(x)
        y.float().square().mean().backward()
        return y

    log = logging.getLogger("torch_flash_backend")
    handler = DecisionLog()
    log.addHandler(handler)
    previous_level = log.level
    rows = []
    try:
        for name, fn in (("prefill (no grad)", prefill), ("train step (fwd+bwd)", train_step)):
            ref = fn().float()
            base_t, base_mem = measure(fn, device, args.reps)
            tfb.reset_stats()
            handler.lines.clear()
            # One call with the decisions logged; the timed ones without (a logger
            # at DEBUG makes every call ask the router, to log it).
            log.setLevel(logging.DEBUG)
            with tfb.enable():
                out = fn().float()
            log.setLevel(previous_level)
            with tfb.enable():
                ours_t, ours_mem = measure(fn, device, args.reps)
            decisions = list(dict.fromkeys(handler.lines))
            rows.append((name, (out - ref).abs().max().item(), base_t, ours_t, base_mem, ours_mem, decisions))
        # Decode steps against the cache: one query token (a generate step) and
        # four (a speculative block, causal); shows the decode rule, and runs the
        # block under enable() against PyTorch's SDPA.
        with torch.no_grad():
            kv = torch.randn(batch, kv_heads, length, hidden // heads, device=device, dtype=dtype)
            q = torch.randn(batch, heads, 1, hidden // heads, device=device, dtype=dtype)
            decode = tfb.explain(q, kv, kv, is_causal=False, enable_gqa=True)
            q4 = torch.randn(batch, heads, 4, hidden // heads, device=device, dtype=dtype)
            block = tfb.explain(q4, kv, kv, is_causal=True, enable_gqa=True)
            ref4 = F.scaled_dot_product_attention(q4, kv, kv, is_causal=True, enable_gqa=True)
            with tfb.enable():
                block_diff = (F.scaled_dot_product_attention(q4, kv, kv, is_causal=True, enable_gqa=True)
                              - ref4).abs().max().item()
    finally:
        log.removeHandler(handler)
        log.setLevel(previous_level)

    def mib(b):
        return "n/a" if b is None else f"{b / 2**20:.0f} MiB"

    print("| run | max |out - ref| | PyTorch time | enabled time | speed-up | PyTorch peak | enabled peak |")
    print("|---|---|---|---|---|---|---|")
    for name, diff, bt, ot, bm, om, _ in rows:
        print(f"| {name} | {diff:.3e} | {bt * 1e3:.2f} ms | {ot * 1e3:.2f} ms | {bt / ot:.2f}x | {mib(bm)} | {mib(om)} |")
    print("\nrouting decisions under enable():")
    for name, *_, decisions in rows:
        for line in decisions or ["(no SDPA call reached the router)"]:
            print(f"  {name}: {line}")
    print(f"  decode step (q length 1, cache {length}): {decode}")
    print(f"  speculative block (q length 4, causal, cache {length}): {block}; max |out - PyTorch| {block_diff:.3e}")
    print(f"\nstats: {tfb.stats()}")


if __name__ == "__main__":
    main()
