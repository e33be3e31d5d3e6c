"""A small grid of forward and backward launches for compute-sanitizer, once with
the forward pinned to sm80 and once with the default families (on Hopper: the
sm90 forward), the backward being sm80's either way. Head dim 192 is the sm90
forward that stages O in Q's buffer; the bf16 shape with more query tiles than
SMs has the persistent sm90 CTAs run several tiles, reusing their buffers.

    compute-sanitizer --tool memcheck python scripts/sanitize_small.py
"""
import torch

import torch_flash_backend as tfb
from torch_flash_backend import testing

ops = torch.ops.torch_flash_backend


def grid(head_dims):
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for e in head_dims:
            shapes = [(1, 4, 17, 17), (1, 4, 130, 67), (1, 4, 67, 200)]
            if dtype == torch.bfloat16:
                shapes.append((2, 8, 1100, 300))  # 144 query tiles of 128 rows
            for (b, h, l, s) in shapes:
                for causal in (False, True):
                    q = torch.randn(b, h, l, e, device="cuda", dtype=dtype)
                    k = torch.randn(b, 2, s, e, device="cuda", dtype=dtype)
                    v = torch.randn(b, 2, s, e, device="cuda", dtype=dtype)
                    out, lse = ops.fwd(q, k, v, None, causal)
                    if l < 1000:  # the backward is sm80's in both passes: the small shapes cover it
                        ops.bwd(torch.randn_like(out), q, k, v, out, lse, None, causal)
    torch.cuda.synchronize()


def main():
    built = set(tfb.built_kernels())
    head_dims = [e for e in (64, 128, 192) if all(f"sm80_{p}_{d}_hdim{e}" in built
                                             for p in ("fwd", "bwd") for d in ("fp16", "bf16"))]
    passes = [("sm80",)]
    sm90 = any(f"sm90_fwd_{d}_hdim{e}" in built for d in ("fp16", "bf16") for e in head_dims)
    if sm90 and torch.cuda.get_device_capability() == (9, 0):
        passes.append(())  # the default: sm90 forwards where built
    for families in passes:
        with testing.kernel_families(*families):
            grid(head_dims)
        print(f"sanitize grid ran: head dims {head_dims}, families {', '.join(families) or 'default'}")


if __name__ == "__main__":
    main()
