"""A digest of the PTX of every registered sm_90a kernel (`gpu_checks.gemm_cases`), compiled on CPU: a refactor that
changes no kernel leaves every digest as it was. Source locations (`.loc`, `.file`, debug sections) are left out, so
code that only moves between cells or lines keeps its digest.

    python tools/ptx_hashes.py > before.txt; ...; python tools/ptx_hashes.py | diff before.txt -
"""
import hashlib, re, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
SHAPE = (4352, 3072, 3840)        # a layer of FLUX.1's: M is a run-time value, N and K are compiled in


def kernel_ptx(ptx: str) -> str:
    "The PTX without source locations and debug sections."
    ptx = re.sub(r"^\s*\.(?:loc|file)\b.*$", "", ptx, flags=re.M)
    ptx = re.sub(r"^\s*\.section\s+\.debug.*?^\s*}", "", ptx, flags=re.M | re.S)
    return "\n".join(l.rstrip() for l in ptx.splitlines() if l.strip() and not l.lstrip().startswith("//"))


def digests() -> dict:
    from gpu_checks import gemm_cases
    from w4a4_book import gemm
    out = {}
    for case, (config, R) in gemm_cases().items():
        p = gemm.example_problem(gemm.spec_for(config), *SHAPE, R)
        out[case] = hashlib.sha256(kernel_ptx(gemm.compile_kernel(config, p).ptx).encode()).hexdigest()[:16]
    return out


if __name__ == "__main__":
    for case, d in digests().items(): print(f"{d}  {case}", flush=True)
