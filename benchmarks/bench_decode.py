"""Decode attention (a few query tokens against a KV cache) beside PyTorch's SDPA backends.

    python benchmarks/bench_decode.py                 # the grid below, markdown table
    python benchmarks/bench_decode.py --batch 8 --lens 1024,65536 --queries 1
    python benchmarks/bench_decode.py --mask cache --used 0.5 --heads 16,16   # a static cache's mask
    python benchmarks/bench_decode.py --batch 8 --lens 1024 --queries 1 --profile   # kernels per call
    python benchmarks/bench_decode.py --packed        # packed batches (varlen), a table of their own
    python benchmarks/bench_decode.py --heads "32,8;32,32;32,4" --backends decode,cudnn   # GQA 4/1/8, two columns
    python benchmarks/bench_decode.py --queries 1 --cold --calls 64   # caches read from DRAM, not the L2

bf16, Hq = 32 query heads on Hkv = 8 kv heads (GQA 4:1), q as (B, L, H, E).transpose(1, 2),
the cache (B, Hkv, S, E) contiguous, as Hugging Face passes them; no mask, or with
--mask cache a boolean (B, 1, L, S) mask over a cache in use up to --used of its
length (causal within the query block), as a static cache's generation step
passes it (Hugging Face repeats K/V to Hq heads itself then: --heads 16,16). Each
backend's call is captured ten times (--calls) in a CUDA graph and the graph replayed, so
the times are the GPU's alone (a decode step's attention takes microseconds,
less than the host needs to issue it; generation loops replay graphs too). The
calls read the same K and V, from the L2 where it holds them; --cold gives the
calls copies to cycle through, more than twice the L2, as a model's layers do.
Backends take turns, one replay each per round; medians.

--packed: the batch as one packed variable-length batch (q (B·L, Hq, E), K/V
(ΣS_b, Hkv, E), int32 offsets), key lengths drawn in [S/2, S]: our decode
family's varlen_fwd, the tiled family's varlen_fwd (sm90 on Hopper, else
sm80) and PyTorch's varlen_attn, causal (bottom-right, as a decode step is).

Columns: µs per call; TB/s of K and V read once (2·B·Hkv·S·E·2 bytes; with a
mask, of the keys in use alone) for the
decode kernel and for the fastest of PyTorch's; default's and cudnn's time over decode's.
"decode" is our decode family's kernel (the op with family="decode"); "enable()"
is F.scaled_dot_product_attention under enable(), whatever the router chose
(the note says which); "default" is PyTorch's SDPA with no backend pinned;
flash, cudnn and efficient are PyTorch's, pinned. A backend that refuses a
shape shows "-". --backends keeps the named columns alone (an A/B of builds
needs decode and cudnn: a third of the time); --heads takes several Hq,Hkv
pairs, separated by ";", a table each.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_flash_backend as tfb

PINNED = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}
BACKENDS = ("decode", "enable()", "default", "flash", "cudnn", "efficient")
CALLS_PER_GRAPH = 10


def call_for(backend, q, k, v, mask):
    gqa = q.size(1) != k.size(1)
    if backend == "decode":
        return lambda: torch.ops.torch_flash_backend.fwd(q, k, v, None, False, "decode", attn_mask=mask)[0]
    if backend == "enable()":
        def routed():
            with tfb.enable():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return routed
    if backend == "default":
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def pinned():
        with sdpa_kernel(PINNED[backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return pinned


def cache_mask(b, length, s, used):
    """(B, 1, L, S): keys [0, used - L + i] visible to query row i."""
    keys = torch.arange(s, device="cuda")
    rows = torch.arange(length, device="cuda")
    return (keys[None, None, None, :] <= (used - length + rows)[None, None, :, None]).expand(b, 1, length, s)


def graph_of(fn):
    """fn captured CALLS_PER_GRAPH times; None when it refuses the shape."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS_PER_GRAPH):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph
    except RuntimeError:
        torch.cuda.synchronize()
        return None


def time_graphs(graphs, rounds):
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return {name: statistics.median(t) for name, t in times.items()}


def kernel_breakdown(graph):
    """The graph's kernels under the profiler: (name, µs per call) summed by name, and
    the span from the first kernel's start to the last one's end per call (launch gaps
    included). Kernels launched to overlap the previous one (the decode family's on
    sm_90 and later) count their wait for it too; compare spans there."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.name and "Memcpy" not in e.name]
    if not kernels:
        return [], 0.0
    totals = {}
    for e in kernels:
        totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / CALLS_PER_GRAPH
    start = min(e.time_range.start for e in kernels)
    end = max(e.time_range.end for e in kernels)
    return sorted(totals.items(), key=lambda kv: -kv[1]), (end - start) / CALLS_PER_GRAPH


def print_breakdown(graphs):
    for name, graph in graphs.items():
        rows, span = kernel_breakdown(graph)
        parts = ", ".join(f"{n[:60]} {t:.1f}" for n, t in rows)
        print(f"    {name}: span {span:.1f} µs per call; kernels µs per call: {parts}", flush=True)


def packed_rows(args, hq, hkv):
    """--packed: the table of packed batches."""
    from torch.nn.attention.varlen import varlen_attn

    tiled = "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80"
    names = ("decode", tiled, "varlen_attn")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; bf16, Hq={hq}, Hkv={hkv}, packed, causal")
    print("| B | L | S (max) | E | " + " | ".join(f"{n} µs" for n in names)
          + " | decode TB/s | varlen_attn / decode |")
    print("|" + "---|" * (len(names) + 6))
    gen = torch.Generator().manual_seed(0)
    for e in map(int, args.head_dims.split(",")):
        for b in map(int, args.batch.split(",")):
            for length in map(int, args.queries.split(",")):
                for s in map(int, args.lens.split(",")):
                    lens_k = torch.randint(s // 2, s + 1, (b,), generator=gen).tolist()
                    if 2 * sum(lens_k) * hkv * e * 2 > args.max_gb * 1e9:
                        continue
                    offsets = [torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32,
                                            device="cuda") for n in ([length] * b, lens_k)]
                    q = torch.randn(b * length, hq, e, device="cuda", dtype=torch.bfloat16)
                    k, v = (torch.randn(sum(lens_k), hkv, e, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                    ours = lambda fam: lambda: torch.ops.torch_flash_backend.varlen_fwd(
                        q, k, v, *offsets, length, max(lens_k), None, True, fam)[0]
                    calls = {"decode": ours("decode"), tiled: ours(tiled),
                             "varlen_attn": lambda: varlen_attn(q, k, v, *offsets, length, max(lens_k),
                                                                window_size=(-1, 0))}
                    graphs = {n: graph_of(c) for n, c in calls.items()}
                    us = time_graphs({n: g for n, g in graphs.items() if g is not None}, args.rounds)
                    cells = [f"{us[n]:.1f}" if n in us else "-" for n in names]
                    decode = us.get("decode")
                    cells.append(f"{2 * sum(lens_k) * hkv * e * 2 / (decode * 1e-6) / 1e12:.2f}" if decode else "-")
                    cells.append(f"{us['varlen_attn'] / decode:.2f}" if decode and "varlen_attn" in us else "-")
                    print(f"| {b} | {length} | {s} | {e} | " + " | ".join(cells) + " |", flush=True)
                    del graphs, q, k, v
                    torch.cuda.empty_cache()


def head_pairs(text):
    """--heads "32,8;32,4" -> [(32, 8), (32, 4)]."""
    pairs = [tuple(map(int, pair.split(","))) for pair in text.split(";") if pair.strip()]
    if not pairs or any(len(p) != 2 or p[0] % p[1] for p in pairs):
        raise SystemExit(f"--heads: Hq,Hkv pairs with Hkv dividing Hq, separated by ';'; got {text!r}")
    return pairs


def backend_list(text):
    """--backends "decode,cudnn" -> ("decode", "cudnn"), in BACKENDS' order."""
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown or not names:
        raise SystemExit(f"--backends: some of {', '.join(BACKENDS)}; got {text!r}")
    return tuple(n for n in BACKENDS if n in names)


def dense_rows(args, hq, hkv, backends):
    """The table of one Hq,Hkv pair (dense caches)."""
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; bf16, Hq={hq}, Hkv={hkv}, mask {args.mask}"
          + (f" (cache in use: {args.used:.0%})" if args.mask == "cache" else ""))
    print("| B | L | S | E | " + " | ".join(f"{b} µs" for b in backends) + " | decode TB/s | best PyTorch TB/s | "
          "default / decode | cudnn / decode | enable() runs |")
    print("|" + "---|" * (len(backends) + 9))
    for e in map(int, args.head_dims.split(",")):
        for b in map(int, args.batch.split(",")):
            for length in map(int, args.queries.split(",")):
                for s in map(int, args.lens.split(",")):
                    if 2 * b * hkv * s * e * 2 > args.max_gb * 1e9:
                        continue
                    used = max(length, round(s * args.used)) if args.mask == "cache" else s
                    kv_bytes = 2 * b * hkv * used * e * 2
                    mask = cache_mask(b, length, s, used) if args.mask == "cache" else None
                    torch.manual_seed(0)
                    q = torch.randn(b, length, hq, e, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                    k = torch.randn(b, hkv, s, e, device="cuda", dtype=torch.bfloat16)
                    v = torch.randn(b, hkv, s, e, device="cuda", dtype=torch.bfloat16)
                    copies = cold_copies(q, k, v, kv_bytes, args) if args.cold else [(q, k, v)]
                    graphs = {name: graph_of(cycling([call_for(name, *c, mask) for c in copies]))
                              for name in backends}
                    us = time_graphs({n: g for n, g in graphs.items() if g is not None}, args.rounds)
                    cells = [f"{us[n]:.1f}" if n in us else "-" for n in backends]
                    tbs = lambda t: f"{kv_bytes / (t * 1e-6) / 1e12:.2f}"
                    best = min((us[n] for n in ("default", "flash", "cudnn", "efficient") if n in us), default=None)
                    decode = us.get("decode")
                    cells.append(tbs(decode) if decode else "-")
                    cells.append(tbs(best) if best else "-")
                    for peer in ("default", "cudnn"):
                        cells.append(f"{us[peer] / decode:.2f}" if decode and peer in us else "-")
                    cells.append(str(tfb.explain(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)))
                    print(f"| {b} | {length} | {s} | {e} | " + " | ".join(cells) + " |", flush=True)
                    if args.profile:
                        print_breakdown({n: g for n, g in graphs.items() if g is not None})
                    del graphs, q, k, v, copies
                    torch.cuda.empty_cache()


def cold_copies(q, k, v, kv_bytes, args):
    """--cold: q, K and V in as many copies (up to --calls) as make the graph's
    calls cycle through more than twice the L2's bytes of K and V, so that each
    call reads its cache from DRAM, as a generate step's layers each do."""
    l2 = torch.cuda.get_device_properties(q.device).L2_cache_size
    n = max(1, min(args.calls, -(-2 * l2 // kv_bytes) + 1))
    return [(q, k, v)] + [(q.clone(), k.clone(), v.clone()) for _ in range(n - 1)]


def cycling(fns):
    """A call that runs fns[0], fns[1], ... in turn, one per call (a graph's
    captured calls thus read the copies in turn)."""
    state = {"next": 0}

    def call():
        fn = fns[state["next"] % len(fns)]
        state["next"] += 1
        return fn()
    return call


def main():
    global CALLS_PER_GRAPH
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--packed", action="store_true", help="packed batches (varlen_fwd, varlen_attn)")
    parser.add_argument("--batch", default="1,8,64")
    parser.add_argument("--lens", default="1024,4096,16384,65536", help="cache lengths S")
    parser.add_argument("--queries", default="1,4,16", help="query lengths L")
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--heads", default="32,8", help="Hq,Hkv; several pairs separated by ';'")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="the columns to measure (default: all)")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--max-gb", type=float, default=8.0, help="skip shapes whose K+V exceed this")
    parser.add_argument("--mask", choices=("none", "cache"), default="none")
    parser.add_argument("--used", type=float, default=1.0, help="with --mask cache: the share of the cache in use")
    parser.add_argument("--profile", action="store_true",
                        help="after each row, each backend's kernels per call (the profiler's µs) and their span")
    parser.add_argument("--calls", type=int, default=CALLS_PER_GRAPH, help="calls captured in each graph")
    parser.add_argument("--cold", action="store_true",
                        help="dense rows: q, K and V in copies the graph's calls cycle through, more than twice "
                             "the L2 (at most --calls copies), so that caches are read from DRAM")
    args = parser.parse_args()
    CALLS_PER_GRAPH = args.calls
    pairs, backends = head_pairs(args.heads), backend_list(args.backends)
    for hq, hkv in pairs:
        if args.packed:
            packed_rows(args, hq, hkv)
        else:
            dense_rows(args, hq, hkv, backends)


if __name__ == "__main__":
    main()
