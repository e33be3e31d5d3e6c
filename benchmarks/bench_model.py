"""A Llama-style model built from a transformers config (no download), timed with and
without enable() in one run: train step, prefill, greedy generation.

    python benchmarks/bench_model.py                       # hidden 2048, 16 heads, 4 KV heads, 8 layers, bf16
    python benchmarks/bench_model.py --layers 2 --new-tokens 32

Rows (median ms of --reps runs, the two variants in turns):
  train step  forward + backward + AdamW step, batch 2, sequence --train-len
  train-padded  the same with a right-padded batch (row 2 valid for 70% of its tokens): the
              boolean attn_mask Hugging Face passes then reaches every attention call
  train-packed  one row of 2 x --train-len tokens packed from documents of 100-2048 tokens,
              position ids restarting per document: Hugging Face's sdpa (a block-diagonal mask it
              builds from the position ids), the same under enable() (our mask path), and
              torch_flash_backend.transformers' attention (our packed kernels, no mask), in
              tokens/s
  train-compiled  the same with the model under torch.compile (compiled once per variant:
              a compiled graph records whether it runs inside enable())
  prefill     one forward over a --prompt-len prompt (batch 1), no grad
  generate    model.generate, greedy, --new-tokens after the prompt (default dynamic cache)
  static      model.generate with a static cache, batch --static-batch, for each of --static-prompts:
              Hugging Face's fast path (it compiles the decode step with torch.compile's
              "reduce-overhead" mode, so each step replays a CUDA graph; the step passes a
              boolean mask over the whole cache). Rows: the whole generate, and one decode
              step, (time of --new-tokens minus time of one) / (--new-tokens - 1).
Then the largest |logit| difference of the prefill, and the share of the train
step's and of one decode step's GPU time spent in attention kernels (profiler; kernels whose names hold
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


def attention_share(fn):
    """Share of fn()'s CUDA time in attention kernels, and its kernels' total µs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    total = sum(e.time_range.elapsed_us() for e in kernels)
    attention = sum(e.time_range.elapsed_us() for e in kernels if any(s in e.name for s in ATTENTION_KERNELS))
    return attention / total if total else float("nan"), total


def decode_step(model, prompt):
    """One one-token decode step after the prompt (its prefill outside the timing)."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)

    def step():
        with torch.no_grad():
            model(prompt[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    return step


def static_rows(model, batch, length, new_tokens, reps):
    """The static-cache generate of `new_tokens` and of one token, with and
    without enable(); rows for the whole run and for one decode step."""
    prompt = torch.randint(0, 32000, (batch, length), device="cuda")

    def generate(n):
        def run():
            with torch.no_grad():
                return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      cache_implementation="static")
        return run
    long = in_turns(variants(generate(new_tokens)), reps)
    short = in_turns(variants(generate(1)), reps)
    step = {name: (long[name] - short[name]) / (new_tokens - 1) for name in long}
    compiled = "compiled" if getattr(model, "_compiled_call", None) is not None else "not compiled"
    # Which attention kernels the enable() run launched (compiled graphs call the
    # ops without asking the router again, so stats() cannot say).
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof, tfb.enable():
        generate(new_tokens)()
        torch.cuda.synchronize()
    names = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and any(s in e.name for s in ATTENTION_KERNELS):
            short_name = e.name.split("<")[0].split("(")[0][-60:]
            names[short_name] = names.get(short_name, 0) + 1
    print(f"static cache, prompt {length}: attention kernels of an enable() generate: {names}")
    return [(f"static generate ({compiled})", f"{batch} x {new_tokens} tokens after {length}", long),
            ("static decode step", f"batch {batch}, cache {length + new_tokens}", step)]


def packed_rows(model, args):
    """The train-packed row (module docstring), tokens/s as the row's note."""
    import torch_flash_backend.transformers as tfb_hf

    gen = torch.Generator().manual_seed(1)
    total, lens = 2 * args.train_len, []
    while sum(lens) < total:
        lens.append(int(torch.randint(100, 2049, (1,), generator=gen)))
    lens[-1] -= sum(lens) - total
    ids = torch.randint(0, 32000, (1, total), device="cuda")
    position_ids = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).cuda()
    labels = ids.clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    name = tfb_hf.register()

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(ids, position_ids=position_ids, labels=labels).loss.backward()
        optimizer.step()

    def with_impl(impl, fn, strict=None):
        def run():
            model.set_attn_implementation(impl)
            try:
                if strict is None:
                    return fn()
                with tfb.enable(strict=strict):
                    return fn()
            finally:
                model.set_attn_implementation("sdpa")
        return run

    fns = {"PyTorch": with_impl("sdpa", step), "enable()": with_impl("sdpa", step, strict=False),
           "varlen": with_impl(name, step)}
    t = in_turns(fns, args.reps)
    del optimizer
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    shape = f"1 x {total}, {len(lens)} documents"
    tokens = {k: total / (v / 1e3) for k, v in t.items()}
    print(f"train step, packed ({shape}): tokens/s PyTorch sdpa {tokens['PyTorch']:.0f}, sdpa under enable() "
          f"{tokens['enable()']:.0f}, torch_flash_backend.transformers {tokens['varlen']:.0f} "
          f"({tokens['varlen'] / tokens['PyTorch']:.2f}x)")
    return [("train step, packed (sdpa)", shape, {"PyTorch": t["PyTorch"], "enable()": t["enable()"]}),
            ("train step, packed (ours: varlen)", shape, {"PyTorch": t["PyTorch"], "enable()": t["varlen"]})]


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
    parser.add_argument("--rows", default="train,train-padded,train-packed,train-compiled,prefill,generate,static",
                        help="which rows to run")
    parser.add_argument("--static-prompts", default="1024,4096", help="prompt lengths of the static-cache rows")
    parser.add_argument("--static-batch", type=int, default=8)
    args = parser.parse_args()
    wanted = set(args.rows.split(","))
    model = build(args)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; Llama hidden {args.hidden}, {args.heads} heads, "
          f"{args.kv_heads} KV heads, {args.layers} layers, bf16")
    rows, notes = [], []

    if "train" in wanted:
        ids = torch.randint(0, 32000, (2, args.train_len), device="cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def train_step():
            optimizer.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
            optimizer.step()
        rows.append(("train step", f"batch 2 x {args.train_len}", in_turns(variants(train_step), args.reps)))
        # What attention bounds: with its kernels taking no time at all, a step
        # would run at most 1 / (1 - share) times faster.
        for name, fn in variants(lambda: attention_share(train_step)).items():
            share, total = fn()
            notes.append(f"train step ({name}): attention {share:.1%} of {total / 1000:.1f} ms of GPU time "
                         f"(a step with free attention: {1 / (1 - share):.2f}x)")
        del optimizer
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    if "train-padded" in wanted:
        ids = torch.randint(0, 32000, (2, args.train_len), device="cuda")
        attention_mask = torch.ones_like(ids)
        attention_mask[1, int(args.train_len * 0.7):] = 0
        labels = ids.masked_fill(attention_mask == 0, -100)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def padded_step():
            optimizer.zero_grad(set_to_none=True)
            model(ids, attention_mask=attention_mask, labels=labels).loss.backward()
            optimizer.step()
        rows.append(("train step, padded batch", f"batch 2 x {args.train_len}, row 2 70% valid",
                     in_turns(variants(padded_step), args.reps)))
        for name, fn in variants(lambda: attention_share(padded_step)).items():
            share, total = fn()
            notes.append(f"padded train step ({name}): attention {share:.1%} of {total / 1000:.1f} ms of GPU time")
        del optimizer
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    if "train-packed" in wanted:
        rows += packed_rows(model, args)
    if "train-compiled" in wanted:
        ids = torch.randint(0, 32000, (2, args.train_len), device="cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        compiled = torch.compile(model)

        def compiled_step():
            optimizer.zero_grad(set_to_none=True)
            compiled(ids, labels=ids).loss.backward()
            optimizer.step()
        rows.append(("train step, torch.compile", f"batch 2 x {args.train_len}",
                     in_turns(variants(compiled_step), args.reps)))
        del optimizer, compiled
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()

    prompt = torch.randint(0, 32000, (1, args.prompt_len), device="cuda")

    def prefill():
        with torch.no_grad():
            return model(prompt).logits
    if "prefill" in wanted:
        rows.append(("prefill", f"1 x {args.prompt_len}", in_turns(variants(prefill), args.reps)))

    def generate():
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                  do_sample=False)
    if "generate" in wanted:
        rows.append(("generate", f"{args.new_tokens} tokens after {args.prompt_len}",
                     in_turns(variants(generate), args.reps)))

    if "static" in wanted:
        for length in (int(x) for x in args.static_prompts.split(",") if x):
            rows += static_rows(model, args.static_batch, length, args.new_tokens, args.reps)

    print("| row | shape | PyTorch ms | enable() ms | speedup |")
    print("|---|---|---|---|---|")
    for name, shape, t in rows:
        print(f"| {name} | {shape} | {t['PyTorch']:.2f} | {t['enable()']:.2f} | {t['PyTorch'] / t['enable()']:.2f} |")

    plain = prefill().float()
    with tfb.enable():
        ours = prefill().float()
    print(f"\nprefill max |logit difference|: {(plain - ours).abs().max().item():.4f} "
          f"(logits up to {plain.abs().max().item():.1f})")
    for note in notes:
        print(note)
    for name, fn in variants(lambda: attention_share(decode_step(model, prompt))).items():
        share, total = fn()
        print(f"decode step ({name}): attention {share:.1%} of {total:.0f} µs of GPU time")
    tfb.reset_stats()
    with tfb.enable():
        generate()
    print(f"routing of a generate run: {tfb.stats()}")


if __name__ == "__main__":
    main()
