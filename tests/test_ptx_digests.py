"""Nothing the GPU verified changes silently: every kernel the package builds, every config a default launch or a tool
builds and every probe's own kernel compiles, on CPU, to the PTX whose digest `tests/ptx_digests.txt` holds (source
locations and entry names aside). A change that means to alter a kernel rewrites the file with
`python -m w4a4_book.checks ptx --write`, and the diff shows which kernels moved."""
from pathlib import Path

from w4a4_book import checks

DIGESTS = Path(__file__).resolve().parent / "ptx_digests.txt"


def _held(prefix: str | None) -> dict:
    held = checks.read_digests(DIGESTS.read_text())
    return {c: d for c, d in held.items() if (prefix is None) != c.startswith("sm100")}


def test_sm90_activation_and_probe_kernels_keep_their_ptx():
    assert checks.digests() == _held(None)


def test_sm100_kernels_keep_their_ptx():
    assert checks.sm100_digests() == _held("sm100")
