"""Ring attention's steps on one GPU, through the provider hook.

PyTorch's context parallelism (torch.distributed.tensor.experimental.context_parallel)
splits a sequence over W ranks and, on each, calls aten's flash ops once per ring step
on local tensors; it merges the steps' partial outputs by their logsumexp in float32,
and its backward calls the flash backward per step with the merged output and
logsumexp (a half of them, made contiguous, where a step used half the queries). Here
every rank's steps run in one process, exactly as the ring would call them, with the
provider active: for causal attention with PyTorch's default head-tail load balancing
(rank r holds chunks r and 2W - 1 - r of 2W: step 0 is causal with L = S; later
steps are not causal and use half the keys or half the queries) and without a mask.
The assembled output, logsumexp and gradients must stay within 2x the error of the
same steps on PyTorch's own flash kernels, against a float64 reference of the whole
sequence, with every step served by our kernels.
"""
import pytest
import torch
import torch.nn.attention as A
import torch.nn.functional as F

import torch_flash_backend as tfb

from reference import assert_within_baseline, attention_ref, max_err

pytestmark = pytest.mark.gpu

aten = torch.ops.aten


def chunk_ids(rank, world, balanced):
    """The sequence chunks a rank holds, of 2W equal ones: head-tail when balanced, else
    its own contiguous pair."""
    return (rank, 2 * world - 1 - rank) if balanced else (2 * rank, 2 * rank + 1)


def shard(t, rank, world, balanced):
    chunks = t.chunk(2 * world, dim=2)
    return torch.cat([chunks[i] for i in chunk_ids(rank, world, balanced)], dim=2)


def unshard(parts, world, balanced):
    """The whole sequence from each rank's local tensor (the inverse of shard)."""
    chunks = [None] * (2 * world)
    for rank, t in enumerate(parts):
        for i, c in zip(chunk_ids(rank, world, balanced), t.chunk(2, dim=2)):
            chunks[i] = c
    return torch.cat(chunks, dim=2)


def step_plan(rank, world, i, causal):
    """(is_causal, which queries, which keys) of ring step i on `rank`: "all" or a half.
    Causal runs load-balanced, as PyTorch's default."""
    if not causal:
        return False, "all", "all"
    if i == 0:
        return True, "all", "all"
    return (False, "all", "first") if i <= rank else (False, "second", "all")


def half(t, which):
    if which == "all":
        return t
    return t.chunk(2, dim=2)[0 if which == "first" else 1]


def merge(out, lse, block_out, block_lse, which_q):
    """The running result merged with a step's, by their logsumexp, in float32 (the
    numerically stable form the ring uses); which_q: the queries the step had."""
    block_out, block_lse = block_out.float(), block_lse.float().unsqueeze(-1)
    if out is None:
        return block_out, block_lse
    o, s = half(out, which_q), half(lse, which_q)
    o = o - torch.sigmoid(block_lse - s) * (o - block_out)
    s = s - F.logsigmoid(s - block_lse)
    if which_q == "all":
        return o, s
    first = out.size(2) // 2
    return torch.cat([out[:, :, :first], o], dim=2), torch.cat([lse[:, :, :first], s], dim=2)


def ring(q, k, v, dout, world, causal):
    """Every rank's forward and backward ring steps through aten's flash ops; returns the
    assembled (out, lse, dq, dk, dv) of the whole sequence."""
    balanced = causal
    qs, ks, vs, douts = ([shard(t, r, world, balanced) for r in range(world)] for t in (q, k, v, dout))
    outs, lses, rests = [], [], []
    for rank in range(world):
        out = lse = None
        for i in range(world):
            src = (rank - i) % world
            is_causal, which_q, which_k = step_plan(rank, world, i, causal)
            o, s, *rest = aten._scaled_dot_product_flash_attention(
                half(qs[rank], which_q), half(ks[src], which_k), half(vs[src], which_k), 0.0, is_causal, False)
            out, lse = merge(out, lse, o, s, which_q)
        outs.append(out.to(q.dtype))
        lses.append(lse.squeeze(-1))
        rests.append(rest)
    dqs = [torch.zeros_like(t, dtype=torch.float32) for t in qs]
    dks = [torch.zeros_like(t, dtype=torch.float32) for t in ks]
    dvs = [torch.zeros_like(t, dtype=torch.float32) for t in vs]
    for rank in range(world):
        cum_q, cum_k, max_q, max_k, seed, offset = rests[rank][:6]
        for i in range(world):
            src = (rank - i) % world
            is_causal, which_q, which_k = step_plan(rank, world, i, causal)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                half(douts[rank], which_q), half(qs[rank], which_q), half(ks[src], which_k),
                half(vs[src], which_k), half(outs[rank], which_q), half(lses[rank], which_q).contiguous(),
                cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset)
            half(dqs[rank], which_q).add_(dq)
            half(dks[src], which_k).add_(dk)
            half(dvs[src], which_k).add_(dv)
    return (unshard(outs, world, balanced), unshard(lses, world, balanced),
            *(unshard([g.to(q.dtype) for g in gs], world, balanced) for gs in (dqs, dks, dvs)))


@pytest.fixture
def provider():
    A.activate_flash_attention_impl("torch_flash_backend")
    try:
        yield
    finally:
        A.restore_flash_attention_impl()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("chunk,e", [(256, 128), (129, 64)])
def test_ring_steps_match_the_whole_sequence(world, causal, chunk, e):
    torch.manual_seed(world * 1000 + chunk + e + causal)
    n = 2 * world * chunk
    q, k, v, dout = (torch.randn(1, n, 8, e, device="cuda", dtype=torch.bfloat16).transpose(1, 2).contiguous()
                     for _ in range(4))
    # PyTorch's own flash kernels on the same steps: the baseline.
    base = ring(q, k, v, dout, world, causal)
    A.activate_flash_attention_impl("torch_flash_backend")
    try:
        tfb.reset_stats()
        ours = ring(q, k, v, dout, world, causal)
        stats = tfb.stats()
    finally:
        A.restore_flash_attention_impl()
    steps = world * world  # every rank runs every step (balanced causal skips none)
    assert stats["fallback"] == {}, stats
    assert sum(stats["routed"].values()) == 2 * steps, stats  # forward and backward

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, is_causal=causal)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    # The emulated ring itself is right: PyTorch's own steps land near the reference
    # (else the 2x rule below would compare against a broken baseline).
    for b, r in zip((base[0], *base[2:]), (ref_out, *ref_grads)):
        assert max_err(b, r) <= 0.02 * r.abs().max().item(), max_err(b, r)
    assert_within_baseline("out", ours[0], base[0], ref_out)
    assert max_err(ours[1], ref_lse) <= 1e-3, max_err(ours[1], ref_lse)
    for name, o, b, r in zip(("dq", "dk", "dv"), ours[2:], base[2:], ref_grads):
        assert_within_baseline(name, o, b, r, floor=1e-4)


def test_steps_keep_the_flash_ops_layouts(provider):
    """What the ring reads of a step: out in the query's layout, logsumexp (B, H, L)
    float32 contiguous, and the backward's gradients in the inputs' layouts."""
    q = torch.randn(1, 512, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.bfloat16)
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, k, 0.0, False, False)
    assert out.stride() == q.stride() and lse.shape == (1, 8, 512) and lse.dtype == torch.float32
    assert lse.is_contiguous()
    half_lse = lse.chunk(2, dim=2)[1].contiguous()
    qh, oh = q.chunk(2, dim=2)[1], out.chunk(2, dim=2)[1]
    grads = aten._scaled_dot_product_flash_attention_backward(oh, qh, k, k, oh, half_lse, None, None, 256, 256, 0.0,
                                                               False, torch.empty(2, dtype=torch.uint64,
                                                                                  device="cuda"),
                                                               torch.empty((), dtype=torch.uint64, device="cuda"))
    assert [g.shape for g in grads] == [qh.shape, k.shape, k.shape]
