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


GPU_TEST_TIMEOUT_S = 300  # far above the slowest GPU test (~15 s with compilation); a pipeline bug hangs instead


@pytest.fixture(autouse=True)
def _hang_watchdog(request):
    """Turn a hung GPU test into a failure: a kernel whose pipeline waits forever blocks the process inside
    CUDA, where no Python timeout can interrupt it, so a timer thread dumps every stack and exits the run."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    import faulthandler, os, sys, threading

    def abort():
        sys.stderr.write(f"\nWATCHDOG: {request.node.nodeid} still running after {GPU_TEST_TIMEOUT_S} s: a hang\n")
        faulthandler.dump_traceback(file=sys.stderr)
        os._exit(3)

    timer = threading.Timer(GPU_TEST_TIMEOUT_S, abort)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
