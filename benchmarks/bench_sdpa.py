"""TFLOP/s of our kernels beside PyTorch's SDPA backends, in one run on one GPU.

    python benchmarks/bench_sdpa.py                       # the full grid, markdown table
    python benchmarks/bench_sdpa.py --head-dims 128 --lens 4096 --modes fwd --causal 1

Grid: bf16, B*L = 16384 tokens, hidden 2048 (H = 2048 / E), q/k/v in the layout
Hugging Face models pass ((B, L, H, E).transpose(1, 2)). FLOPs: 4*B*H*L*S*E for
the forward, 2.5x that for the backward (so 3.5x for forward+backward), halved
when causal. Times are medians of CUDA-event timings after warm-up; within a
row the backends take turns, one timed call each per round, so that each sees
the card in the same state (under sustained load an H100's clock sinks as it
meets its power cap, and the backend timed first would get the coolest card).
The host queues the calls without waiting for them, so the events time the
GPU's work, not the host's launch overhead (--sync waits after every call).

Backends: "ours" runs our ops with every kernel family (on Hopper the sm90
forward and the sm80 backward), "ours-sm80" the same ops pinned to sm80 with
TFB_KERNEL_FAMILIES (left out where it would equal "ours"); flash, cudnn and
efficient are PyTorch's, default its SDPA with no backend chosen (what a
model gets without us); fa4 is FlashAttention-4's flash_attn_func (pip
package flash-attn-4; left out where it is not installed), on the same
(B, L, H, E) memory. With --dropout P every backend runs SDPA's dropout_p = P
(FlashAttention-4 has none and is left out) and "ours-nodrop" is ours
without it, for the cost of drawing the mask. The table prints as markdown,
ready for RESULTS.md; notes (the kernels ours runs, backends that refused a
shape) follow it.
"""
import argparse
import contextlib
import math
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def attention_flops(b, h, l, s, e, causal, mode, ev=None):
    """ev: v's head dim (None: e); Q K^T costs 2 L S e, P V 2 L S ev."""
    fwd = 2 * b * h * l * s * (e + (e if ev is None else ev))
    if causal:
        fwd //= 2
    return fwd * (3.5 if mode == "fwdbwd" else 1.0)


def time_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_in_turns(runs, warmup, reps, sync=False):
    """Median milliseconds of each of `runs` ({name: (context, fn)}), timed in
    turns: every round times one call of each. The host queues the calls
    without waiting, as a training loop does, so the events time the GPU's
    work; with `sync` it waits after every call, and each time then includes
    the host's work up to the first launch. A run whose warm-up raises
    RuntimeError (a backend that does not take the shape) is dropped and its
    error returned instead of a time."""
    results = {}
    for name, (context, fn) in list(runs.items()):
        try:
            with context():
                for _ in range(warmup):
                    fn()
        except RuntimeError as err:
            results[name] = err
            del runs[name]
    torch.cuda.synchronize()
    events = {name: [] for name in runs}
    for _ in range(reps):
        for name, (context, fn) in runs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with context():
                start.record()
                fn()
                end.record()
            if sync:
                end.synchronize()
            events[name].append((start, end))
    torch.cuda.synchronize()
    results.update({name: statistics.median(a.elapsed_time(b) for a, b in pairs) for name, pairs in events.items()})
    return results


def make_inputs(b, h, l, e, dtype, grad, group=1, ev=None):
    """q with h heads, k and v with h / group (the (B, L, H, E).transpose(1, 2)
    layout); v's head dim ev (None: e)."""
    def one(heads, dim=e):
        t = torch.randn(b, l, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)
        return t.requires_grad_(grad)

    return one(h), one(h // group), one(h // group, e if ev is None else ev)


# ours-det: ours under torch.use_deterministic_algorithms(True) (dQ summed in a
# fixed order by the backward; the forward is the same).
OURS = ("ours", "ours-sm80", "ours-det", "ours-nodrop")
RATIO_TO = ("ours-nodrop", "ours-sm80", "default", "flash", "cudnn", "fa4")
DROPOUT = 0.0  # --dropout


def fa4(name="flash_attn_func"):
    """FlashAttention-4's function `name` (flash_attn.cute), or None where it is not installed."""
    try:
        import flash_attn.cute as cute
    except Exception:
        return None
    return getattr(cute, name, None)


def families(backend):
    """The kernel families (and determinism) `backend` runs with, held for as long as it is timed."""
    if backend not in ("ours-sm80", "ours-det"):
        return contextlib.nullcontext()
    from torch_flash_backend import testing

    return testing.deterministic_algorithms() if backend == "ours-det" else testing.kernel_families("sm80")


def sm90_serves_forward():
    import torch_flash_backend as tfb

    return torch.cuda.get_device_capability() == (9, 0) and any(n.startswith("sm90_fwd") for n in tfb.built_kernels())


def runner(backend, q, k, v, causal, mode):
    """A closure running one forward (or forward+backward) with `backend`."""
    gqa = k.shape[1] != q.shape[1]
    if backend in OURS:
        import torch_flash_backend as tfb

        p = 0.0 if backend == "ours-nodrop" else DROPOUT

        def fwd():
            return tfb.flash_attn(q, k, v, dropout_p=p, is_causal=causal, enable_gqa=gqa)
    elif backend == "fa4":
        flash4 = fa4()

        def fwd():  # (B, L, H, E) views of the same memory; GQA by k/v's head count
            out = flash4(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    elif backend == "default":
        def fwd():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT, is_causal=causal, enable_gqa=gqa)
    else:
        def fwd():
            with sdpa_kernel(BACKENDS[backend]):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT, is_causal=causal,
                                                      enable_gqa=gqa)
    return as_run(fwd, q, k, v, mode)


def as_run(fwd, q, k, v, mode):
    """A closure running fwd() without grad ("fwd"), or fwd() and its backward ("fwdbwd")."""
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fwd()
        return run
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)  # out's shape

    def run():
        torch.autograd.grad(fwd(), (q, k, v), grad_out)
    return run


def gemm_tflops(dtype, n=8192, warmup=3, reps=10):
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = time_ms(lambda: a @ b, warmup, reps)
    return 2 * n**3 / ms / 1e9


def peak_memory_mib(backend, b, h, l, e, dtype, causal):
    """Peak allocated bytes of one forward+backward beyond its inputs."""
    q, k, v = make_inputs(b, h, l, e, dtype, True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if backend == "math":
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    else:
        with families(backend):
            runner(backend, q, k, v, causal, "fwdbwd")()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--lens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--group", type=int, default=1, help="query heads per kv head (GQA; 1: as many kv heads)")
    p.add_argument("--value-head-dim", type=int, default=None,
                   help="v's head dim where it differs from q's and k's (e.g. 128 with --head-dims 192)")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--backends", default="ours,ours-sm80,flash,cudnn,efficient,fa4")
    p.add_argument("--dropout", type=float, default=0.0, help="SDPA's dropout_p for every backend")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sync", action="store_true",
                   help="wait for every timed call before the next (times include the host's launch work)")
    p.add_argument("--memory", action="store_true", help="also report peak memory against math and flash")
    p.add_argument("--gemm", action="store_true", help="also report the bf16 GEMM rate (8192^3)")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        sys.exit("bench_sdpa.py needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    backends = args.backends.split(",")
    notes = []
    global DROPOUT
    DROPOUT = args.dropout
    if DROPOUT and "fa4" in backends:
        backends.remove("fa4")
        notes.append("fa4 left out: FlashAttention-4 has no dropout")
    if not DROPOUT and "ours-nodrop" in backends:
        backends.remove("ours-nodrop")
    if "ours-sm80" in backends and not sm90_serves_forward():
        backends.remove("ours-sm80")
        notes.append("ours-sm80 left out: no sm90 forward runs here, so ours is sm80 already")
    if "fa4" in backends and fa4() is None:
        backends.remove("fa4")
        notes.append("fa4 left out: flash_attn.cute (pip install flash-attn-4) is not installed")
    print(f"# {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
          f"torch {torch.__version__}, {args.dtype}, {args.tokens} tokens/batch, hidden {args.hidden}, "
          f"{'GQA %d query heads per kv head, ' % args.group if args.group > 1 else ''}"
          f"{'dropout_p %g, ' % DROPOUT if DROPOUT else ''}"
          f"{'synchronised after every call' if args.sync else 'calls queued'}\n")
    if args.gemm:
        print(f"bf16 GEMM 8192^3: {gemm_tflops(torch.bfloat16):.0f} TFLOP/s\n")

    modes = args.modes.split(",")
    head_dims = [int(x) for x in args.head_dims.split(",")]
    if "ours" in backends:
        import torch_flash_backend as tfb

        for e in head_dims:
            q = torch.empty(1, args.hidden // e, 1024, e, device="cuda", dtype=dtype, requires_grad="fwdbwd" in modes)
            notes.append(f"ours, E={e}: {tfb.explain(q, q, q, is_causal=True)}")

    ratios = [b for b in RATIO_TO if b in backends] if "ours" in backends else []
    cols = backends + [f"ours/{b}" for b in ratios]
    print("| mode | causal | E | L | B | H | " + " | ".join(cols) + " |")
    print("|" + "---|" * (6 + len(cols)))
    for mode in modes:
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            for e in head_dims:
                for l in (int(x) for x in args.lens.split(",")):
                    b, h = max(1, args.tokens // l), args.hidden // e
                    q, k, v = make_inputs(b, h, l, e, dtype, mode == "fwdbwd", args.group, args.value_head_dim)
                    flops = attention_flops(b, h, l, l, e, causal, mode, args.value_head_dim)
                    runs = {x: (lambda x=x: families(x), runner(x, q, k, v, causal, mode)) for x in backends}
                    rates = {}
                    for backend, ms in time_in_turns(runs, args.warmup, args.reps, args.sync).items():
                        if isinstance(ms, RuntimeError):
                            rates[backend] = math.nan
                            notes.append(f"{backend} {mode} causal={int(causal)} E={e} L={l}: "
                                         f"{str(ms).splitlines()[0][:120]}")
                        else:
                            rates[backend] = flops / ms / 1e9
                    cells = [f"{rates[x]:.0f}" for x in backends] + [f"{rates['ours'] / rates[x]:.2f}" for x in ratios]
                    print(f"| {mode} | {int(causal)} | {e} | {l} | {b} | {h} | " + " | ".join(cells) + " |", flush=True)
                    del q, k, v
    if notes:
        print()
        for note in notes:
            print(f"- {note}")
    if args.memory:
        mem_backends = [x for x in ("ours", "ours-sm80", "flash", "math") if x in backends or x == "math"]
        print("\nPeak memory of one forward+backward (MiB beyond the inputs):\n")
        print("| causal | E | L | B | H | " + " | ".join(mem_backends) + " |")
        print("|" + "---|" * (5 + len(mem_backends)))
        for l in (1024, 4096):
            e = 128
            b, h = max(1, args.tokens // l), args.hidden // e
            row = [peak_memory_mib(x, b, h, l, e, dtype, True) for x in mem_backends]
            print(f"| 1 | {e} | {l} | {b} | {h} | " + " | ".join(f"{m:.0f}" for m in row) + " |", flush=True)


if __name__ == "__main__":
    main()
