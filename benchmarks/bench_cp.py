"""A Llama-style training step under PyTorch's context parallelism, our kernels beside PyTorch's.

    torchrun --nproc-per-node 2 benchmarks/bench_cp.py                  # 64K tokens over 2 GPUs, causal
    torchrun --nproc-per-node 2 benchmarks/bench_cp.py --check          # also against a one-GPU reference
    torchrun --nproc-per-node 2 benchmarks/bench_cp.py --no-causal

The sequence is split over the ranks by torch.distributed.tensor.experimental.context_parallel
(head-tail load balancing for causal attention, PyTorch's default); every attention call then
runs as ring steps of aten's fused SDPA ops on local tensors. Variants, in turns:
  ours       our provider active (activate_flash_attention_impl("torch_flash_backend")),
             SDPA held to the flash backend, whose ring steps our kernels then serve
  flash      PyTorch's flash kernels
  cudnn      PyTorch's cuDNN kernels
A step: forward, the summed cross-entropy over the rank's tokens / all tokens, backward, the
gradients all-reduced. Printed: tokens per second of each variant (median of --reps), and on
each rank the ring steps' routing (stats(): every step served, none passed on).

--check: rank 0 also runs the whole sequence on one GPU in float32 (the reference), and each
variant's loss and gradients (all-reduced) are compared with it: ours' error must be at most
2x flash's (plus a floor), as the rest of the suite's 2x rule.

The model's layers are run directly (embedding, decoder layers with rotary embeddings of the
true positions, norm, head), so that Hugging Face's mask logic never sees the shards'
non-contiguous positions; attention gets attn_mask=None and is_causal, as the model would pass.
"""
import argparse
import contextlib
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

E2E_FLOOR = 1e-4


def build(args, device):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq, attn_implementation="sdpa")
    torch.manual_seed(0)  # the same weights on every rank
    model = transformers.LlamaForCausalLM(config).to(device, torch.bfloat16)
    for layer in model.model.layers:
        layer.self_attn.is_causal = args.causal
    return model


def loss_sum(model, ids, labels, positions):
    """The summed cross-entropy of these tokens, running the model's parts directly."""
    inner = model.model
    hidden = inner.embed_tokens(ids)
    embeddings = inner.rotary_emb(hidden, positions)
    for layer in inner.layers:
        out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=embeddings)
        hidden = out[0] if isinstance(out, tuple) else out
    logits = model.lm_head(inner.norm(hidden)).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def flat_grads(model):
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def variant_context(name):
    """SDPA's backend (and our provider) for a variant, held for one step."""
    import torch.nn.attention as A
    from torch.nn.attention import SDPBackend, sdpa_kernel

    stack = contextlib.ExitStack()
    if name == "ours":
        A.activate_flash_attention_impl("torch_flash_backend")
        stack.callback(A.restore_flash_attention_impl)
    stack.enter_context(sdpa_kernel(SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION))
    return stack


def cp_step(model, mesh, name, ids, labels, positions):
    """One context-parallel step; returns (loss, flat gradients), both summed over the ranks."""
    from torch.distributed.tensor.experimental import context_parallel

    model.zero_grad(set_to_none=True)
    tokens = ids.size(1)  # all of them: each rank's loss is its tokens' sum over all tokens
    ids, labels, positions = ids.clone(), labels.clone(), positions.clone()  # sharded in place
    with variant_context(name), context_parallel(mesh, buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1]):
        total = loss_sum(model, ids, labels, positions)
        (total / tokens).backward()
    total = total.detach()
    dist.all_reduce(total)
    grads = flat_grads(model)
    dist.all_reduce(grads)
    return total / tokens, grads


def reference(model, ids, labels, positions):
    """The whole sequence on one GPU in float32 (efficient or math SDPA)."""
    import copy

    ref = copy.deepcopy(model).float()
    ref.zero_grad(set_to_none=True)
    total = loss_sum(ref, ids, labels, positions)
    (total / ids.size(1)).backward()
    return (total / ids.size(1)).detach(), flat_grads(ref)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--variants", default="ours,flash,cudnn")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--check", action="store_true", help="compare loss and gradients with a one-GPU reference")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("run under torchrun, e.g. torchrun --nproc-per-node 2 benchmarks/bench_cp.py")
    import torch_flash_backend as tfb
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _cp_options

    # The rank's GPU before the group: NCCL's barrier otherwise guesses it (and warns).
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    # Head-tail load balancing is PyTorch's default for causal attention and refused without it.
    _cp_options.enable_load_balance = args.causal
    model = build(args, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(args.vocab, (1, args.seq), generator=g).to(device)
    labels = ids.roll(-1, dims=1)
    positions = torch.arange(args.seq, device=device)[None]
    variants = args.variants.split(",")

    results, times, stats = {}, {v: [] for v in variants}, None
    for rep in range(args.reps + 1):  # the first round warms up
        for name in variants:
            if name == "ours":
                tfb.reset_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            start.record()
            try:
                results[name] = cp_step(model, mesh, name, ids, labels, positions)
            except RuntimeError as err:  # a backend that cannot take the call
                results[name] = err
                continue
            end.record()
            torch.cuda.synchronize()
            if rep > 0:
                times[name].append(start.elapsed_time(end))
            if name == "ours":
                stats = tfb.stats()
    routed = [None] * world
    dist.all_gather_object(routed, stats if "ours" in variants else None)

    status = 0
    if rank == 0:
        print(f"# {torch.cuda.get_device_name()} x {world}, torch {torch.__version__}, bf16, seq {args.seq}, "
              f"hidden {args.hidden}, {args.heads} heads, {args.layers} layers, "
              f"{'causal (head-tail load balancing)' if args.causal else 'not causal'}\n")
        print("| variant | ms per step | tokens/s | vs flash |")
        print("|---|---|---|---|")
        flash_ms = statistics.median(times["flash"]) if times.get("flash") else None
        for name in variants:
            if isinstance(results.get(name), RuntimeError):
                print(f"| {name} | - ({str(results[name]).splitlines()[0][:80]}) | - | - |")
                continue
            ms = statistics.median(times[name])
            ratio = f"{flash_ms / ms:.2f}" if flash_ms else "-"
            print(f"| {name} | {ms:.1f} | {args.seq / ms * 1e3:,.0f} | {ratio} |")
        if "ours" in variants:
            print()
            for r, s in enumerate(routed):
                print(f"rank {r} ring steps (ours): {s}")
                if s is None or s["fallback"] or not s["routed"]:
                    print(f"rank {r}: a ring step was passed on to PyTorch's kernels")
                    status = 1
    if args.check:
        ref = reference(model, ids, labels, positions) if rank == 0 else None
        if rank == 0:
            print("\n| variant | loss | |loss - ref| | max |grad - ref| |")
            print("|---|---|---|---|")
            print(f"| reference (one GPU, fp32) | {ref[0].item():.6f} | - | - |")
            errors = {}
            for name in variants:
                if isinstance(results.get(name), RuntimeError):
                    continue
                loss, grads = results[name]
                errors[name] = ((loss - ref[0]).abs().item(), (grads - ref[1]).abs().max().item())
                print(f"| {name} | {loss.item():.6f} | {errors[name][0]:.2e} | {errors[name][1]:.2e} |")
            if "ours" in errors and "flash" in errors:
                for i, what in enumerate(("loss", "gradients")):
                    if errors["ours"][i] > 2 * errors["flash"][i] + E2E_FLOOR:
                        print(f"FAIL: ours' {what} error {errors['ours'][i]:.2e} > 2 x flash's {errors['flash'][i]:.2e}")
                        status = 1
            print("check:", "passed" if status == 0 else "FAILED")
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
