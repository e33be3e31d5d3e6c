"""A small grid of forward and backward launches for compute-sanitizer.

    compute-sanitizer --tool memcheck python scripts/sanitize_small.py
"""
import torch

import torch_flash_backend  # noqa: F401  (loads the op library)

ops = torch.ops.torch_flash_backend


def main():
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for e in (64, 128):
            for (l, s) in ((17, 17), (130, 67), (67, 200)):
                for causal in (False, True):
                    q = torch.randn(1, 4, l, e, device="cuda", dtype=dtype)
                    k = torch.randn(1, 2, s, e, device="cuda", dtype=dtype)
                    v = torch.randn(1, 2, s, e, device="cuda", dtype=dtype)
                    out, lse = ops.fwd(q, k, v, None, causal)
                    ops.bwd(torch.randn_like(out), q, k, v, out, lse, None, causal)
    torch.cuda.synchronize()
    print("sanitize grid ran")


if __name__ == "__main__":
    main()
