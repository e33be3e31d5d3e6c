"""Calls of the decode kernel alone (or of PyTorch's cuDNN attention) on one shape, for a profiler to look at:

    ncu -k regex:split_kernel --launch-skip 3 --launch-count 1 python3 benchmarks/decode_calls.py --batch 8 --len 1024
    ncu -k regex:fprop --launch-skip 3 --launch-count 1 python3 benchmarks/decode_calls.py --backend cudnn

bf16, q as (B, L, Hq, E).transpose(1, 2), the cache (B, Hkv, S, E) contiguous (bench_decode.py's layout).
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_flash_backend  # noqa: F401  (loads the ops)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--len", type=int, default=1024, help="cache length S")
    parser.add_argument("--queries", type=int, default=1, help="query length L")
    parser.add_argument("--heads", default="32,8", help="Hq,Hkv")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--backend", choices=("decode", "cudnn"), default="decode")
    args = parser.parse_args()
    hq, hkv = map(int, args.heads.split(","))
    q = torch.randn(args.batch, args.queries, hq, args.head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(args.batch, hkv, args.len, args.head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for _ in range(args.calls):
        if args.backend == "decode":
            torch.ops.torch_flash_backend.fwd(q, k, v, None, False, "decode")
        else:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
