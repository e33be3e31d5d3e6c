"""Masked attention: our kernels beside PyTorch's SDPA backends on the same masked call.

    python benchmarks/bench_masks.py                      # every mask, fwd and fwd+bwd
    python benchmarks/bench_masks.py --masks window --modes fwd
    python benchmarks/bench_masks.py --profile             # ours' kernels per call, the pre-pass apart
    python benchmarks/bench_masks.py --profile --plain     # and those of the same call unmasked

bf16, E = 128 and 16 heads (--head-dim E: 2048 / E heads), q/k/v as (B, L, H, E).transpose(1, 2); a boolean
attn_mask (True = take part) as Hugging Face models pass it:
  keep-all   (B, 1, 1, S) padding mask with every key valid, B 4, L 4K
  padding    (B, 1, 1, S), batch row i valid up to 100%, 85%, 70%, 55% of S
  window     (1, 1, L, S) causal band of 4096 keys, B 1, L 16K
  random     (B, H, L, S) half the pairs visible, no tile empty, B 4, L 4K
or an additive one (bf16, added to the scaled scores):
  padding-additive  the padding mask as 0 / -inf (what SDPA turns a boolean mask into)
  alibi      (1, H, L, S) ALiBi: -slope(head) x distance below the diagonal, -inf above
             (causal), B 4, L 4K: every visible tile reads its values
  padding-min  (B, 1, 1, S) the padding mask as 0 / finfo.min (older Hugging Face code):
             finite values, so the padded tiles read them (one row per tile)
  causal-min (B, 1, L, S) causal and padding as 0 / finfo.min (older Hugging Face code's 4-D
             mask): every tile above the diagonal reads its values

Columns: milliseconds of "ours" (the ops on the masked call, the router's
families), "ours-plain" (ours without the mask: not causal for keep-all,
padding and random, causal for window and alibi), PyTorch's default SDPA and its
efficient and cuDNN backends on the same masked call (a backend that refuses
it prints "-"); then ours/plain and default/ours, and for the window the
time target of 1.3 x the plain causal time x the share of causal pairs the
band keeps. "ours-dense" (window only, with --backends) is ours unmasked and not causal
over the first WINDOW + 128 keys: every query tile then runs the band's steady-state
count of 128 x 128 tiles (33) with no mask to read; scaled by the band's tile count
over its own, it is the window's kernel time at the unmasked per-tile rate, printed in
the notes beside the target. Backends take turns, one timed call each per round (bench_sdpa.py's
time_in_turns), medians of CUDA-event times.
"""
import argparse
import contextlib
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_sdpa import as_run, make_inputs, time_in_turns

HEADS, E, WINDOW = 16, 128, 4096
MASKS = {  # name: (batch, length)
    "keep-all": (4, 4096),
    "padding": (4, 4096),
    "window": (1, 16384),
    "random": (4, 4096),
    "padding-additive": (4, 4096),
    "alibi": (4, 4096),
    "padding-min": (4, 4096),
    "causal-min": (4, 4096),
}
CAUSAL = ("window", "alibi", "causal-min")  # ours-plain runs these causal
PYTORCH = {"default": None, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def make_mask(kind, b, length):
    keys = torch.arange(length, device="cuda")
    if kind == "keep-all":
        return torch.ones(b, 1, 1, length, dtype=torch.bool, device="cuda")
    if kind == "padding":
        valid = torch.tensor([1.0, 0.85, 0.7, 0.55][:b], device="cuda").mul(length).long()
        return (keys[None] < valid[:, None])[:, None, None]
    if kind == "window":
        rows = keys[:, None]
        return ((keys[None] <= rows) & (keys[None] > rows - WINDOW))[None, None]
    if kind == "random":
        g = torch.Generator(device="cuda").manual_seed(0)
        return torch.rand(b, HEADS, length, length, device="cuda", generator=g) > 0.5
    if kind == "padding-additive":
        return torch.zeros(b, 1, 1, length, device="cuda", dtype=torch.bfloat16).masked_fill(
            ~make_mask("padding", b, length), float("-inf"))
    if kind == "alibi":
        slopes = 2.0 ** -torch.arange(1, HEADS + 1, device="cuda", dtype=torch.float32)
        distance = (keys[:, None] - keys[None, :]).float()  # row - key
        bias = -(slopes[:, None, None] * distance).masked_fill(distance < 0, float("inf"))
        return bias.to(torch.bfloat16)[None]
    if kind in ("padding-min", "causal-min"):
        keep = make_mask("padding", b, length)
        if kind == "causal-min":
            keep = keep & (keys[None, :] <= keys[:, None])
        low = torch.finfo(torch.bfloat16).min
        return torch.zeros(keep.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, low)
    raise ValueError(kind)


def band_share(length, window):
    """The share of causal (row, key) pairs a causal band of `window` keys keeps."""
    kept = sum(min(i + 1, window) for i in range(length))
    return kept / (length * (length + 1) / 2)


def band_tiles(length, window, tile=128):
    """128 x 128 tiles holding a pair of the causal band (what the masked kernels visit),
    and those of ours-dense (every query tile over window + tile keys)."""
    band = sum(m - max(0, (m * tile - window + 1) // tile) + 1 for m in range(length // tile))
    return band, (length // tile) * ((window + tile) // tile)


def runner(backend, q, k, v, mask, kind, mode):
    """A call of `backend` on mask `kind`'s inputs; ours-plain runs the CAUSAL kinds causal."""
    import torch_flash_backend as tfb

    if backend in ("ours-band", "flash-band"):
        # The window as a band (no mask in memory): ours through the ops' window
        # arguments, PyTorch's FlashAttention-2 through its flash op's window_size.
        def fwd():
            if kind != "window":
                raise RuntimeError(f"{backend}: the window row only")
            if backend == "ours-band":
                chosen = tfb._router.decide(q, k, v, is_causal=True, window=(WINDOW - 1, -1), pinned=True)
                return torch.ops.torch_flash_backend.fwd(q, k, v, None, True, chosen.family, chosen.backward_family,
                                                         window_left=WINDOW - 1)[0]
            blhe = [t.transpose(1, 2) for t in (q, k, v)]
            length = q.size(2)
            return torch.ops.aten._flash_attention_forward(
                *blhe, None, None, length, length, 0.0, True, False, window_size_left=WINDOW - 1,
                window_size_right=0)[0].transpose(1, 2)
    elif backend == "ours-dense":
        keys = WINDOW + 128

        def fwd():
            if kind != "window":  # dropped by time_in_turns, printed "-"
                raise RuntimeError("ours-dense: the window row only")
            return tfb.flash_attn(q, k[:, :, :keys], v[:, :, :keys])
    elif backend == "ours":
        def fwd():
            return tfb.flash_attn(q, k, v, attn_mask=mask)
    elif backend == "ours-plain":
        def fwd():
            return tfb.flash_attn(q, k, v, is_causal=kind in CAUSAL)
    else:
        def fwd():
            ctx = contextlib.nullcontext() if PYTORCH[backend] is None else sdpa_kernel(PYTORCH[backend])
            with ctx:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return as_run(fwd, q, k, v, mode)


def profile(args):
    """Each of ours' kernels per masked call, µs of GPU time (medians over the profiled calls)."""
    import torch_flash_backend as tfb

    for mode in args.modes.split(","):
        for kind in args.masks.split(","):
            b, length = MASKS[kind]
            q, k, v = make_inputs(b, HEADS, length, E, torch.bfloat16, mode == "fwdbwd")
            mask = make_mask(kind, b, length)
            for backend in ("ours", "ours-plain") if args.plain else ("ours",):
                run = runner(backend, q, k, v, mask, kind, mode)
                for _ in range(args.warmup):
                    run()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.reps):
                        run()
                    torch.cuda.synchronize()
                print(f"{mode} {kind} (B {b}, L {length}), {backend}: µs per call")
                for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
                    if e.device_time_total > 0:
                        print(f"  {e.device_time_total / args.reps:9.1f}  x{e.count // args.reps}  {e.key[:100]}")
            del q, k, v, mask


def main(argv=None):
    global E, HEADS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--masks", default=",".join(MASKS))
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--backends", default="ours,ours-plain,default,efficient,cudnn")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--profile", action="store_true",
                   help="instead of the table, ours' kernels per call (the mask pre-pass apart), torch.profiler")
    p.add_argument("--plain", action="store_true", help="with --profile: ours-plain's kernels too")
    p.add_argument("--head-dim", type=int, default=E, help="E; the heads become 2048 / E (hidden 2048)")
    args = p.parse_args(argv)
    E, HEADS = args.head_dim, 2048 // args.head_dim
    if not torch.cuda.is_available():
        sys.exit("bench_masks.py needs a CUDA GPU")
    import torch_flash_backend as tfb

    if args.profile:
        return profile(args)
    backends = args.backends.split(",")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, E {E}, {HEADS} heads, ms per call\n")
    cols = backends + ["ours/plain", "default/ours", "window target"]
    print("| mode | mask | B | L | " + " | ".join(cols) + " |")
    print("|" + "---|" * (4 + len(cols)))
    notes = []
    for mode in args.modes.split(","):
        for kind in args.masks.split(","):
            b, length = MASKS[kind]
            q, k, v = make_inputs(b, HEADS, length, E, torch.bfloat16, mode == "fwdbwd")
            mask = make_mask(kind, b, length)
            if mode == "fwd":
                notes.append(f"{kind}: {tfb.explain(q, k, v, attn_mask=mask)}")
            runs = {x: (contextlib.nullcontext, runner(x, q, k, v, mask, kind, mode)) for x in backends}
            ms = time_in_turns(runs, args.warmup, args.reps)
            t = {x: (math.nan if isinstance(ms[x], RuntimeError) else ms[x]) for x in backends}
            for x in backends:
                if isinstance(ms[x], RuntimeError) and x != "ours-dense":
                    notes.append(f"{x} {mode} {kind}: {str(ms[x]).splitlines()[0][:120]}")
            ratio = lambda a, c: t.get(a, math.nan) / t.get(c, math.nan)  # noqa: E731
            target = 1.3 * t.get("ours-plain", math.nan) * band_share(length, WINDOW) if kind == "window" else math.nan
            cells = [("-" if math.isnan(t[x]) else f"{t[x]:.3f}") for x in backends]
            cells += [f"{ratio('ours', 'ours-plain'):.2f}", f"{ratio('default', 'ours'):.2f}",
                      "" if math.isnan(target) else f"{target:.3f}"]
            print(f"| {mode} | {kind} | {b} | {length} | " + " | ".join(cells) + " |", flush=True)
            if kind == "window" and not math.isnan(t.get("ours-dense", math.nan)):
                band, dense = band_tiles(length, WINDOW)
                notes.append(f"window {mode}: ours-dense {t['ours-dense']:.3f} ms over {dense} tiles a head; at that "
                             f"per-tile rate the band's {band} tiles take {t['ours-dense'] * band / dense:.3f} ms "
                             f"(target {target:.3f}, ours {t['ours']:.3f})")
            del q, k, v, mask
    print()
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
