"""A digest of the PTX of every kernel the package builds, compiled on CPU: each registered sm_90a GEMM configuration
(`gpu_checks.gemm_cases`), each mode of the activation kernel, and (with `--sm100`) the sm_100a kernels. A refactor
that changes no kernel leaves every digest as it was. Source locations (`.loc`, `.file`, debug sections) and entry
names are left out, so code that only moves between cells, lines or modules keeps its digest.

    python tools/ptx_hashes.py > before.txt; ...; python tools/ptx_hashes.py | diff before.txt -
    python tools/ptx_hashes.py --write       # the digests tests/test_ptx_digests.py holds the package to
"""
import hashlib, re, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
SHAPE = (4352, 3072, 3840)        # a layer of FLUX.1's: M is a run-time value, N and K are compiled in


DIGESTS = Path(__file__).resolve().parent.parent / "tests" / "ptx_digests.txt"
QUANT_CASES = ((128, True), (32, True), (0, False))          # (R, smooth) of each activation-kernel mode


def kernel_ptx(ptx: str) -> str:
    "The PTX without source locations, debug sections, comments and entry names (each entry becomes `ENTRY<i>`)."
    ptx = re.sub(r"^\s*\.(?:loc|file)\b.*$", "", ptx, flags=re.M)
    ptx = re.sub(r"^\s*\.section\s+\.debug.*?^\s*}", "", ptx, flags=re.M | re.S)
    for i, name in enumerate(dict.fromkeys(re.findall(r"\.entry\s+([\w$]+)", ptx))):
        ptx = re.sub(rf"(?<![\w$]){re.escape(name)}(?=_param_|[^\w$])", f"ENTRY{i}", ptx)
    return "\n".join(l.rstrip() for l in ptx.splitlines() if l.strip() and not l.lstrip().startswith("//"))


def digest(ptx: str) -> str:
    return hashlib.sha256(kernel_ptx(ptx).encode()).hexdigest()[:16]


def sm100_cases() -> dict:
    "The sm_100a kernels: v1 and v2, one CTA and a pair, with and without LoRA, under both accountings."
    from w4a4_book import smem
    v1 = {f"sm100 v1 cta_group={g} R={R} {a}": (smem.Sm100V1Config(cta_group=g, tile_m=128 * g, lora_accounting=a), R)
          for g, R, a in ((1, 32, "per_cta"), (1, 0, "per_cta"), (2, 32, "per_cta"), (2, 32, "pair"), (2, 128, "pair"))}
    v2 = {f"sm100 v2 cta_group={g} R={R} {a} tile_n={n} acc_stages={s}":
          (smem.Sm100V2Config(cta_group=g, tile_m=128 * g, lora_accounting=a, tile_n=n, acc_stages=s), R)
          for g, R, a, n, s in ((2, 32, "per_cta", 256, 1), (2, 128, "pair", 256, 1), (2, 0, "per_cta", 256, 1),
                                (1, 32, "per_cta", 256, 1), (2, 32, "per_cta", 128, 2))}
    return {**v1, **v2}


def gemm_ptx(config, R: int, arch=None) -> str:
    "The PTX of `config`'s kernel at `SHAPE` and rank `R` (for `arch`, default the config's)."
    from w4a4_book import jit, registry
    return jit.compile_kernel(config, jit.example_problem(registry.spec_for(config), *SHAPE, R), arch=arch).ptx


def digests(sm100: bool = False) -> dict:
    "`{case: digest}` of every sm_90a GEMM case and activation-kernel mode (and the sm_100a kernels with `sm100`)."
    from gpu_checks import gemm_cases
    from w4a4_book import act_quant
    out = {}
    for case, (config, R) in gemm_cases().items():
        out[case] = digest(gemm_ptx(config, R))
    for mode in act_quant.QUANT_MODES:
        for R, smooth in QUANT_CASES:
            ptx = act_quant.compile_quant(R=R, smooth=smooth, mode=mode)[0]
            out[f"activation {mode} R={R} smooth={smooth}"] = digest(ptx)
    for case, (config, R) in (sm100_cases() if sm100 else {}).items():
        out[case] = digest(gemm_ptx(config, R, "sm_100a"))
    return out


def read_digests(path: Path = DIGESTS) -> dict:
    return {case: d for d, case in (l.split("  ", 1) for l in path.read_text().splitlines() if l.strip())}


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sm100", action="store_true", help="the sm_100a kernels too (each compiles in a subprocess)")
    ap.add_argument("--write", action="store_true", help=f"write every digest, sm_100a included, to {DIGESTS.name}")
    a = ap.parse_args()
    found = digests(sm100=a.sm100 or a.write)
    lines = [f"{d}  {case}" for case, d in found.items()]
    if a.write: DIGESTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
