"""Nothing the GPU verified changes silently: every kernel the package builds compiles, on CPU, to the PTX whose
digest `tests/ptx_digests.txt` holds (source locations and entry names aside). A change that means to alter a kernel
rewrites the file with `python tools/ptx_hashes.py --write`, and the diff shows which kernels moved."""
import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "ptx_hashes.py"
spec = importlib.util.spec_from_file_location("ptx_hashes", TOOL)
ptx_hashes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ptx_hashes)


def _held(prefix: str | None) -> dict:
    held = ptx_hashes.read_digests()
    return {c: d for c, d in held.items() if (prefix is None) != c.startswith("sm100")}


def test_sm90_and_activation_kernels_keep_their_ptx():
    assert ptx_hashes.digests() == _held(None)


def test_sm100_kernels_keep_their_ptx():
    found = {c: ptx_hashes.digest(ptx_hashes.gemm_ptx(cfg, R, "sm_100a"))
             for c, (cfg, R) in ptx_hashes.sm100_cases().items()}
    assert found == _held("sm100")


def test_digests_ignore_locations_and_entry_names():
    a = ".version 8.0\n.entry kernel_a(\n.param .u64 kernel_a_param_0\n)\n{\n.loc 1 2 3\nret;\n}"
    b = ".version 8.0\n// moved\n.entry kernel_b(\n.param .u64 kernel_b_param_0\n)\n{\n.loc 4 5 6\nret;\n}"
    assert ptx_hashes.digest(a) == ptx_hashes.digest(b)
    assert ptx_hashes.digest(a) != ptx_hashes.digest(a.replace("ret;", "exit;"))
