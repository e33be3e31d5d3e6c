"""The float64 reference every kernel is checked against, and the error rule.

The accuracy rule: our error against this reference may be at most about twice
the error of PyTorch's own same-dtype SDPA on the same inputs (plus a small floor
so that exact-by-luck baselines do not demand exactness from us).
"""
import math
import zlib

import torch

from torch_flash_backend._library import constant

ADDITIVE_LIMIT = constant("additive_limit")  # src/common/mask_values.h kAdditiveLimit, as the library reports it


def attention_ref(q, k, v, scale=None, is_causal=False, attn_mask=None):
    """Float64 attention on SDPA-layout inputs, GQA by head groups, top-left causal,
    an attn_mask broadcast to (B, Hq, L, S): boolean (True = take part) or
    additive (added to the scaled scores; a finite value beyond
    +-ADDITIVE_LIMIT takes the scaled score's place).

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
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask.to(scores.device), float("-inf"))
    elif attn_mask is not None:  # -inf as a boolean mask's False, so that no gradient flows there
        m = attn_mask.to(scores.device, torch.float64)
        hidden = torch.isneginf(m)
        added = (scores + m.masked_fill(hidden, 0.0)).masked_fill(hidden, float("-inf"))
        # A finite value beyond +-ADDITIVE_LIMIT replaces the score (src/common/mask_values.h):
        # float32 SDPA loses the score against finfo.min, so such a row attends uniformly;
        # the gradient reaches the score as SDPA's math backend passes it, as if added.
        beyond = torch.isfinite(m) & (m.abs() > ADDITIVE_LIMIT)
        scores = torch.where(beyond, scores + (ADDITIVE_LIMIT * m.sign() - scores).detach(), added)
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


def stable_seed(*parts) -> int:
    """A seed from a test's parameters, the same in every process (hash() of a
    string is not: PYTHONHASHSEED), so that a failing draw reproduces."""
    return zlib.crc32(repr(parts).encode())
