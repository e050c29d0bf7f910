"Shared pytest setup: the `gpu` marker, and skipping GPU tests where there is no CUDA device."
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one (`pytest -m gpu` runs only these)")


def _cuda_available() -> bool:
    "Whether torch sees a CUDA device (imported only when some test needs the answer)."
    import torch
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_tests or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in gpu_tests:
        item.add_marker(skip)
