"""Forward and backward calls of one dense shape by one backend, for a profiler to look at:

    ncu -k regex:bwd --launch-skip 2 --launch-count 1 python3 benchmarks/dense_calls.py --backend ours
    ncu -k regex:Bwd --launch-skip 2 --launch-count 1 python3 benchmarks/dense_calls.py --backend fa4

bf16, (B, L, H, E) tensors as FlashAttention-4 takes them; ours and cudnn get their
.transpose(1, 2) views (the model layout). Each call runs forward then backward.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_flash_backend as tfb
from bench_sdpa import fa4


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--len", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", type=int, default=0)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--backend", choices=("ours", "fa4", "cudnn"), default="ours")
    args = parser.parse_args()
    shape = (args.batch, args.len, args.heads, args.head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    flash4 = fa4() if args.backend == "fa4" else None
    if args.backend == "fa4" and flash4 is None:
        raise SystemExit("fa4: flash_attn.cute is not installed")
    causal = bool(args.causal)
    for _ in range(args.calls):
        if args.backend == "fa4":
            out = flash4(q, k, v, causal=causal)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(dout)
        else:
            ctx = tfb.enable(strict=True) if args.backend == "ours" else sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
            with ctx:
                out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)
                out.backward(dout.transpose(1, 2))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
