"""Threads running attention at once, to find what breaks under concurrency.

    python scripts/thread_stress.py [--threads 4] [--iters 50] [--mode enable|ops|pytorch]
                                    [--no-backward] [--outside] [--e 64]

--mode enable: SDPA under enable() in every thread (strict and lenient mixed);
ops: the fwd/bwd ops called directly; pytorch: PyTorch's SDPA alone (no
enable()). --outside adds a thread running PyTorch's SDPA outside enable().
Prints one line: OK with the call count, or the first error. Each thread runs on
the current (default) stream, as a user's threads do.
"""
import argparse
import threading

import torch
import torch.nn.functional as F

import torch_flash_backend as tfb
from torch_flash_backend import _router

ops = torch.ops.torch_flash_backend


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--mode", default="enable", choices=["enable", "ops", "pytorch"])
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--outside", action="store_true")
    p.add_argument("--e", type=int, default=64)
    args = p.parse_args()

    torch.manual_seed(0)
    q, k, v, g = (torch.randn(2, 40, 4, args.e, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                  for _ in range(4))
    errors, calls = [], [0]
    lock = threading.Lock()

    def step(strict):
        leaves = [t.detach().requires_grad_(not args.no_backward) for t in (q, k, v)]
        if args.mode == "ops":
            family, backward_family = _router.pinned_families(*leaves, is_causal=True)
            out, lse = ops.fwd(*leaves, None, True, family)
            if not args.no_backward:
                ops.bwd(g, *leaves, out, lse, None, True, backward_family)
            return
        if args.mode == "enable":
            with tfb.enable(strict=strict):
                out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        if not args.no_backward:
            torch.autograd.grad(out, leaves, g)

    def worker(strict):
        try:
            for _ in range(args.iters):
                step(strict)
                with lock:
                    calls[0] += 1
            torch.cuda.synchronize()
        except BaseException as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")

    def outside(stop):
        try:
            while not stop.is_set():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True), leaves, g)
            torch.cuda.synchronize()
        except BaseException as e:  # noqa: BLE001
            errors.append(f"outside: {type(e).__name__}: {str(e).splitlines()[0]}")

    stop = threading.Event()
    threads = [threading.Thread(target=worker, args=(i % 2 == 1,)) for i in range(args.threads)]
    if args.outside:
        threads.append(threading.Thread(target=outside, args=(stop,)))
    for t in threads:
        t.start()
    for t in threads[: args.threads]:
        t.join()
    stop.set()
    for t in threads[args.threads:]:
        t.join()
    try:
        torch.cuda.synchronize()
    except BaseException as e:  # noqa: BLE001
        errors.append(f"final sync: {type(e).__name__}: {str(e).splitlines()[0]}")
    print("OK" if not errors else "FAIL", calls[0], "calls;", errors[0] if errors else "")


if __name__ == "__main__":
    main()
