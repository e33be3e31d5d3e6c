"""FP8 attention forward in TFLOP/s: our e4m3 kernel (the op, and PyTorch's
quantized SDPA with the provider active, as a user calls it) beside our bf16
forward and PyTorch's bf16 backends (flash, cuDNN, efficient) and
FlashAttention-4's bf16 forward where installed, on the same shapes. Backends
in turns, one table; ratios against our bf16 forward and the best PyTorch one.

    python benchmarks/bench_fp8.py [--head-dims 128,256] [--lens 4096,16384] [--causal 0,1]
        [--tokens 32768] [--heads 16]

q, k, v as models pass them ((B, L, H, E) memory seen as (B, H, L, E));
batch = tokens / L. FLOPs: 4 B H L^2 E, halved when causal.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, activate_flash_attention_impl, restore_flash_attention_impl, sdpa_kernel
from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import (
    _scaled_dot_product_attention_quantized)

import torch_flash_backend  # noqa: F401  (registers the provider)
from bench_sdpa import fa4

ops = torch.ops.torch_flash_backend
PYTORCH = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}


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


def calls(b, h, length, e, causal):
    def blhe(dtype):
        return torch.randn(b, length, h, e, device="cuda").mul_(4).to(dtype).transpose(1, 2)

    q, k, v = (blhe(torch.bfloat16) for _ in range(3))
    q8, k8, v8 = (blhe(torch.float8_e4m3fn) for _ in range(3))
    ds = [torch.rand(b, h, device="cuda") + 0.5 for _ in range(3)]
    table = {
        "ours fp8": lambda: ops.fp8_fwd(q8, k8, v8, *ds, None, causal, True),
        "ours fp8 sdpa": lambda: _scaled_dot_product_attention_quantized(q8, k8, v8, is_causal=causal,
                                                                         q_descale=ds[0], k_descale=ds[1],
                                                                         v_descale=ds[2]),
        "ours bf16": lambda: ops.fwd(q, k, v, None, causal, "sm90"),
    }
    for name, backend in PYTORCH.items():
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        table[f"pytorch {name} bf16"] = run
    flash4 = fa4()
    if flash4 is not None:
        qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))
        table["fa4 bf16"] = lambda: flash4(qf, kf, vf, causal=causal)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="128,256")
    parser.add_argument("--lens", default="4096,16384")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; TFLOP/s, best of {args.rounds} rounds "
          f"in turns; tokens {args.tokens}, heads {args.heads}")
    print("| E | L | causal | ours fp8 | via quantized SDPA | ours bf16 | best PyTorch bf16 | FA4 bf16 | "
          "fp8 / ours bf16 | fp8 / best PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in map(int, args.head_dims.split(",")):
        for length in map(int, args.lens.split(",")):
            for causal in (bool(int(c)) for c in args.causal.split(",")):
                b = max(1, args.tokens // length)
                flops = 4 * b * args.heads * length * length * e / (2 if causal else 1)
                table = calls(b, args.heads, length, e, causal)
                best = {}
                for _ in range(args.rounds):
                    for name, fn in table.items():
                        # The provider only for the quantized SDPA: active, it would serve PyTorch's flash row.
                        if name == "ours fp8 sdpa":
                            activate_flash_attention_impl("torch_flash_backend")
                        try:
                            t = timed(fn, args.reps, args.warmup)
                        except RuntimeError as err:  # a backend that refuses the shape
                            print(f"({name}: {str(err).splitlines()[0][:100]})")
                            continue
                        finally:
                            if name == "ours fp8 sdpa":
                                restore_flash_attention_impl()
                        best[name] = max(best.get(name, 0.0), flops / t / 1e12)
                pytorch = max((v for n, v in best.items() if n.startswith("pytorch")), default=0.0)
                fp8, bf16 = best.get("ours fp8", 0.0), best.get("ours bf16", 0.0)
                fa4_cell = f"{best['fa4 bf16']:.0f}" if "fa4 bf16" in best else "-"
                print(f"| {e} | {length} | {int(causal)} | {fp8:.0f} | {best.get('ours fp8 sdpa', 0.0):.0f} | "
                      f"{bf16:.0f} | {pytorch:.0f} | {fa4_cell} | {fp8 / max(bf16, 1e-9):.2f}x | "
                      f"{fp8 / max(pytorch, 1e-9):.2f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
