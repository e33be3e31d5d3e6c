"""FlashAttention-style kernels for torch.nn.functional.scaled_dot_product_attention.

    import torch_flash_backend as tfb
    with tfb.enable():          # SDPA calls in this thread go to our kernels when they fit
        y = model(x)
    tfb.explain(q, k, v)        # why a call would (not) be served
    tfb.explain_varlen(q, k, v, cu_q, cu_k, max_q, max_k)   # the same for varlen_attn's packed batches
    tfb.stats()                 # routed calls by kernel, fallbacks by reason
    tfb.flash_attn(q, k, v)     # the ops directly, with autograd

torch.nn.attention.activate_flash_attention_impl("torch_flash_backend") makes our
kernels replace PyTorch's flash kernels process-wide instead.
"""
from . import _library  # noqa: F401  (first: checks the installed torch, then loads the op library)
from . import _provider  # noqa: F401  (registers the provider with torch.nn.attention)
from ._enable import UnsupportedError, enable, explain, explain_varlen
from ._library import built_kernels
from ._stats import reset_stats, stats
from .functional import flash_attn

__version__ = "0.1.0"

__all__ = [
    "UnsupportedError",
    "__version__",
    "built_kernels",
    "enable",
    "explain",
    "explain_varlen",
    "flash_attn",
    "reset_stats",
    "stats",
]
