"""A head dim run on a larger kernel, against the kernel's own: TFLOP/s of E 80 and 72
(both on sm90's 80 kernel on Hopper) and 64, with equal heads, and of E 72 as the first 72
columns of E-80 heads (each head's row 160 bytes after the previous head's, as at E 80),
under enable(); (B, L, H, E) tensors, L 16K, B 1, bf16, not causal. Padding alone predicts
E 72 at 72/80 of E 80's rate.

    python3 benchmarks/padded_rows.py
"""
import torch
import torch.nn.functional as F

import torch_flash_backend as tfb


def timed(fn, reps=10):
    """Milliseconds a call, CUDA events around reps calls after three."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    length, heads = 16384, 25
    print("| E | head stride | fwd TFLOP/s | fwd+bwd TFLOP/s | kernel |")
    print("|---|---|---|---|---|")
    for e, row in ((80, 80), (72, 72), (72, 80), (64, 64)):
        q, k, v, dout = (torch.randn(1, length, heads, row, device="cuda", dtype=torch.bfloat16)[..., :e]
                         .transpose(1, 2) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        flops = 4 * heads * length * length * e
        with tfb.enable(strict=True):
            fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v))
            fwdbwd = timed(lambda: F.scaled_dot_product_attention(q, k, v).backward(dout))
        print(f"| {e} | {row} | {flops / fwd / 1e9:.0f} | {3.5 * flops / fwdbwd / 1e9:.0f} | "
              f"{tfb.explain(q, k, v).kernel} |")


if __name__ == "__main__":
    main()
