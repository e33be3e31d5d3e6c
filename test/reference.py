"""The float64 reference every kernel is checked against, and the error rule.

The accuracy rule: our error against this reference may be at most about twice
the error of PyTorch's own same-dtype SDPA on the same inputs (plus a small floor
so that exact-by-luck baselines do not demand exactness from us).
"""
import math

import torch


def attention_ref(q, k, v, scale=None, is_causal=False, attn_mask=None):
    """Float64 attention on SDPA-layout inputs, GQA by head groups, top-left causal,
    a boolean attn_mask (True = take part) broadcast to (B, Hq, L, S).

    Returns (out, lse) in float64; lse is the natural-log logsumexp of the scaled
    scores, -inf for rows that see no key (their output is 0). Differentiable with
    respect to q, k, v.
    """
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        L, S = scores.shape[-2:]
        visible = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask.to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).masked_fill(lse.unsqueeze(-1) == float("-inf"), 0.0))
    probs = torch.nan_to_num(probs, nan=0.0)
    return probs @ v, lse


def max_err(x, ref):
    """Largest absolute difference; NaN or inf anywhere in x makes it inf."""
    x = x.to(torch.float64)
    if not torch.isfinite(x).all():
        return float("inf")
    if x.numel() == 0:
        return 0.0
    return (x - ref.to(torch.float64)).abs().max().item()


def assert_within_baseline(name, ours, baseline, ref, factor=2.0, floor=1e-5):
    """ours must be at most `factor` x baseline's error against ref (+ floor)."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    err, base = max_err(ours, ref), max_err(baseline, ref)
    assert err <= factor * base + floor, f"{name}: error {err:.3e} > {factor} x baseline {base:.3e} + {floor:g}"
    return err, base


def poison_(t):
    """Fill with NaN so that an element a kernel forgets to write fails the check."""
    return t.fill_(float("nan"))
