"""A Llama-style model built from a transformers config (no download), timed with and
without enable() in one run: train step, prefill, greedy generation.

    python benchmarks/bench_model.py                       # hidden 2048, 16 heads, 4 KV heads, 8 layers, bf16
    python benchmarks/bench_model.py --layers 2 --new-tokens 32

Rows (median ms of --reps runs, the two variants in turns):
  train step  forward + backward + AdamW step, batch 2, sequence --train-len
  prefill     one forward over a --prompt-len prompt (batch 1), no grad
  generate    model.generate, greedy, --new-tokens after the prompt (default dynamic cache)
Then the largest |logit| difference of the prefill, and the share of one decode
step's GPU time spent in attention kernels (profiler; kernels whose names hold
"attention", "flash", "fmha" or our families' namespaces).
"""
import argparse
import statistics
import time

import torch

import torch_flash_backend as tfb

ATTENTION_KERNELS = ("attention", "flash", "fmha", "tfb::", "3tfb")


def build(args):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def in_turns(fns, reps):
    """Median ms per variant, the variants run in turns after one warm-up each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def variants(fn):
    def ours():
        with tfb.enable():
            return fn()
    return {"PyTorch": fn, "enable()": ours}


def attention_share(model, prompt):
    """Share of a one-token decode step's CUDA time in attention kernels, and the step's kernels' total µs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        out = model(prompt, use_cache=True)
        step = prompt[:, -1:]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(step, past_key_values=out.past_key_values, use_cache=True)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    total = sum(e.time_range.elapsed_us() for e in kernels)
    attention = sum(e.time_range.elapsed_us() for e in kernels if any(s in e.name for s in ATTENTION_KERNELS))
    return attention / total if total else float("nan"), total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--train-len", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    model = build(args)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; Llama hidden {args.hidden}, {args.heads} heads, "
          f"{args.kv_heads} KV heads, {args.layers} layers, bf16")
    rows = []

    ids = torch.randint(0, 32000, (2, args.train_len), device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    rows.append(("train step", f"batch 2 x {args.train_len}", in_turns(variants(train_step), args.reps)))
    del optimizer
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()

    prompt = torch.randint(0, 32000, (1, args.prompt_len), device="cuda")

    def prefill():
        with torch.no_grad():
            return model(prompt).logits
    rows.append(("prefill", f"1 x {args.prompt_len}", in_turns(variants(prefill), args.reps)))

    def generate():
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                  do_sample=False)
    rows.append(("generate", f"{args.new_tokens} tokens after {args.prompt_len}", in_turns(variants(generate),
                                                                                      args.reps)))

    print("| row | shape | PyTorch ms | enable() ms | speedup |")
    print("|---|---|---|---|---|")
    for name, shape, t in rows:
        print(f"| {name} | {shape} | {t['PyTorch']:.1f} | {t['enable()']:.1f} | {t['PyTorch'] / t['enable()']:.2f} |")

    plain = prefill().float()
    with tfb.enable():
        ours = prefill().float()
    print(f"\nprefill max |logit difference|: {(plain - ours).abs().max().item():.4f} "
          f"(logits up to {plain.abs().max().item():.1f})")
    for name, fn in variants(lambda: attention_share(model, prompt)).items():
        share, total = fn()
        print(f"decode step ({name}): attention {share:.1%} of {total:.0f} µs of GPU time")
    tfb.reset_stats()
    with tfb.enable():
        generate()
    print(f"routing of a generate run: {tfb.stats()}")


if __name__ == "__main__":
    main()
