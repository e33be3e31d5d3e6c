"""torch.nn.attention.bias.CausalBias as the ops' flags.

A CausalBias passed as attn_mask (causal_upper_left, causal_lower_right) is a
causal mask of one alignment, not data: the ops take it as is_causal=True with
bottom_right saying the alignment. As PyTorch decides it (CausalBias._dispatch):
an upper-left bias, or one whose own lengths are equal, is SDPA's top-left
is_causal; a lower-right one of unequal lengths aligns the diagonal with the
last key, and rows before it see no key (their output is 0, as PyTorch's).
"""
import torch
from torch.nn.attention.bias import CausalBias, CausalVariant


def is_causal_bias(attn_mask) -> bool:
    return isinstance(attn_mask, CausalBias)


def causal_flags(attn_mask, is_causal, who: str):
    """(attn_mask, is_causal, bottom_right) for the ops: a CausalBias becomes the
    flags, anything else passes through with bottom_right False. Raises as
    PyTorch does for a CausalBias with is_causal=True."""
    if not isinstance(attn_mask, CausalBias):
        return attn_mask, is_causal, False
    if is_causal:
        raise ValueError(f"{who}: CausalBias should not be used with causal=True (as scaled_dot_product_attention)")
    return None, True, bottom_right_of(attn_mask)


def bottom_right_of(bias: CausalBias) -> bool:
    return bias.variant == CausalVariant.LOWER_RIGHT and bias.seq_len_q != bias.seq_len_kv


def lower_right(q: torch.Tensor, k: torch.Tensor) -> CausalBias:
    """The bias that PyTorch's SDPA reads as bottom-right causal for these inputs."""
    return torch.nn.attention.bias.causal_lower_right(q.size(-2), k.size(-2))
