"""Hugging Face transformers' attention on our kernels, packed sequences included.

transformers' ``sdpa`` attention turns a packed batch (documents concatenated
into one row, ``position_ids`` restarting at each document) into a
materialized block-diagonal mask. This module registers an attention function
through transformers' ``AttentionInterface`` that gives such a batch to our
packed variable-length kernels instead, with no mask::

    import torch_flash_backend.transformers as tfb_hf
    name = tfb_hf.register()                       # "tfb_packed"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    model(input_ids, position_ids=position_ids)    # position_ids restart per document

What it serves, per call (q as transformers passes it, (B, H, L, E)):
- a packed batch: B == 1 with ``cu_seq_lens_q`` / ``cu_seq_lens_k`` /
  ``max_length_q`` / ``max_length_k`` (transformers' flattening collator), or
  ``position_ids`` that restart (read on the host, as transformers' own flash
  path does): causal attention per document (``varlen_fwd``);
- a padded batch (a 2-D ``attention_mask``, no cache): the real tokens packed
  and served the same way, zeros at the padding;
- otherwise (no mask): causal attention over the whole row, bottom-right
  aligned when a cache makes the keys longer than the query (``flash_attn``).
A padded batch with a cache, sliding windows, softcapping, attention sinks or
``output_attentions`` raise NotImplementedError naming the case (use
``attn_implementation="sdpa"`` under ``torch_flash_backend.enable()``).
"""
import torch
from torch.nn.attention.bias import causal_lower_right

from . import _autograd  # noqa: F401  (the ops, fake kernels and autograd)
from . import _router, _stats
from .functional import flash_attn

# transformers reads a name holding "flash" as one of its flash-attention kernels.
NAME = "tfb_packed"

_ops = torch.ops.torch_flash_backend


def register(name: str = NAME) -> str:
    """Registers the attention function (and transformers' flash-style mask,
    which is None unless the batch is padded) under `name`; returns it, for
    ``attn_implementation=name``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _offsets_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """A packed row's document offsets (int32, documents + 1) from position
    ids that restart at each document's first token, or None for one document."""
    positions = position_ids.reshape(-1)
    starts = (positions == positions.min()).nonzero().view(-1)
    if starts.numel() <= 1:
        return None
    end = torch.tensor([positions.numel()], device=positions.device)
    return torch.cat((starts, end)).to(torch.int32)


def _packed(query, key, value, cu_q, cu_k, max_q, max_k, scaling):
    """Causal attention per document of a packed (1, H, total, E) batch; returns (1, total, H, E)."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (total, H, E) views
    max_q, max_k = int(max_q), int(max_k)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    decision = _router.decide_varlen(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, scaling, needs_grad=needs_grad,
                                     pinned=True)
    _stats.count(decision)
    if not decision.served:
        raise NotImplementedError(f"torch_flash_backend: {decision.reason}")
    out, _ = _ops.varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scaling, True, decision.family,
                             decision.backward_family)
    return out.unsqueeze(0)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention signature: (B, H, L, E) inputs, (B, L, H, E) output."""
    for what, bad in (("dropout", dropout), ("sliding_window", sliding_window), ("softcap", softcap),
                      ("attention sinks (s_aux)", s_aux is not None),
                      ("output_attentions", kwargs.get("output_attentions", False))):
        if bad:
            raise NotImplementedError(f"torch_flash_backend.transformers: {what} is not supported; use "
                                      "attn_implementation='sdpa' under torch_flash_backend.enable()")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise NotImplementedError("torch_flash_backend.transformers: non-causal attention is not supported; use "
                                  "attn_implementation='sdpa' under torch_flash_backend.enable()")
    b, _, length, _ = query.shape
    s = key.size(2)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and b == 1:
        return _packed(query, key, value, cu_q.to(torch.int32), cu_k.to(torch.int32), kwargs["max_length_q"],
                       kwargs["max_length_k"], scaling), None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or s != length:
            raise NotImplementedError("torch_flash_backend.transformers: a padded batch with a cache is not "
                                      "supported; use attn_implementation='sdpa' under torch_flash_backend.enable()")
        # The real tokens, packed: one document per row.
        keep = attention_mask.reshape(-1).bool()
        rows = keep.nonzero().view(-1)
        lens = attention_mask.sum(-1, dtype=torch.int32)
        cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        flat = [t.transpose(1, 2).reshape(b * length, t.size(1), t.size(3))[rows].transpose(0, 1).unsqueeze(0)
                for t in (query, key, value)]
        longest = int(lens.max())
        out = _packed(*flat, cu, cu, longest, longest, scaling)[0]
        full = out.new_zeros(b * length, out.size(1), out.size(2)).index_copy(0, rows, out)
        return full.view(b, length, out.size(1), out.size(2)), None
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and b == 1 and length > 1 and s == length:
        cu = _offsets_from_positions(position_ids)
        if cu is not None:
            longest = int((cu[1:] - cu[:-1]).max())
            return _packed(query, key, value, cu, cu, longest, longest, scaling), None
    enable_gqa = query.size(1) != key.size(1)
    if s == length:
        out = flash_attn(query, key, value, is_causal=length > 1, scale=scaling, enable_gqa=enable_gqa)
    else:  # a cache: the query is the row's last tokens
        out = flash_attn(query, key, value, attn_mask=causal_lower_right(length, s), scale=scaling,
                         enable_gqa=enable_gqa)
    return out.transpose(1, 2), None
