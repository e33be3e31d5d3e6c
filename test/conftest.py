import pytest
import torch


def cuda_capability():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_collection_modifyitems(config, items):
    cap = cuda_capability()
    skip = pytest.mark.skip(reason="needs a CUDA GPU of compute capability >= 8.0")
    for item in items:
        if "gpu" in item.keywords and (cap is None or cap[0] < 8):
            item.add_marker(skip)
