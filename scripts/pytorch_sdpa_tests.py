"""PyTorch's own SDPA tests run against our kernels through the provider hook.

A pytest plugin: loaded with `-p pytorch_sdpa_tests` (scripts/ on PYTHONPATH), it
activates our flash-attention implementation for the whole session, so PyTorch's
`_scaled_dot_product_flash_attention` and its backward run our kernels wherever we
serve the call (and PyTorch's where we pass it on), then prints which kernels served
how many calls and why the others were passed on. The tests come from PyTorch's
repository at the installed torch's version (test/test_transformers.py); they are not
part of this package. scripts/pytorch_sdpa_tests.sh runs them.
"""

import torch

import torch_flash_backend as tfb


def pytest_configure(config):
    torch.nn.attention.activate_flash_attention_impl("torch_flash_backend")
    tfb.reset_stats()


def pytest_terminal_summary(terminalreporter):
    counts = tfb.stats()
    terminalreporter.write_line("torch_flash_backend served: " + repr(counts["routed"]))
    terminalreporter.write_line("torch_flash_backend passed on: " + repr(counts["fallback"]))
