"""The GPU batch of a commit, each step saved as a record with provenance, in this order: the GPU test suite;
compute-sanitizer on one small launch of every registered sm_90a kernel and of the activation passes; and the
records the book reads (the LoRA bug's move with its depth curves, and the int4_pg ladder).

    python tools/gpu_checks.py suite --out nbs/data/gpu_suite_h200.json [--workers 8]
    python tools/gpu_checks.py sanitize --out nbs/data/sanitizer_h200.json [--workers 6]
    python tools/gpu_checks.py records --out-dir nbs/data [--only moves ladder]
    python tools/gpu_checks.py diagnose --out nbs/data/diagnose_h200.json   # the refused configs, under memcheck
    python tools/gpu_checks.py launch CASE     # one launch of CASE, what `sanitize` runs under each tool

`suite` runs `pytest -m gpu` (spread over `--workers` processes with pytest-xdist where it is installed), then runs the
tests that failed again, one process, so that a failure caused by sharing the GPU is told apart from a real one.
"""
import argparse, re, subprocess, sys, tempfile, time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHAPE = (300, 512, 512)          # M: a partial tile; N: two pairs of 128 columns; K: four K-blocks
SANITIZERS = ("memcheck", "racecheck", "synccheck")
LAUNCH_TIMEOUT_S = 600           # one case under one tool; racecheck is the slowest


def gemm_cases() -> dict:
    "Every registered sm_90a kernel, one CTA and (where it takes one) a pair: `{name: (config, R)}`."
    from w4a4_book import smem
    return {"v1 int4": (smem.HopperV1Config(), 32), "v1 int4 pair": (smem.HopperV1Config(cluster_n=2), 32),
            "v2 int4": (smem.HopperV2Config(), 32), "v2 int4 pair": (smem.HopperV2Config(cluster_n=2), 128),
            "v1 int4_pg": (smem.HopperPgV1Config(), 32), "v1 int4_pg pair": (smem.HopperPgV1Config(cluster_n=2), 32),
            "v2 int4_pg": (smem.HopperPgConfig(), 32), "v2 int4_pg pair": (smem.HopperPgConfig(cluster_n=2), 128),
            "v2 int4_pg lora ring": (smem.HopperPgConfig(tile_m=128, cluster_n=2, lora_stages=3, lora_chunk=64), 128),
            "v2 int4_pg smem": (smem.HopperPgSmemConfig(), 32), "v2sk int4_pg": (smem.HopperPgStreamKConfig(), 32)}


ACTIVATION_CASES = {f"activation {fmt}": fmt for fmt in ("int4", "int4_pg", "int8")}   # int8: W4A8's activations


def refused_cases() -> dict:
    "Configs the library refuses because they failed on the GPU, launched past that guard only to locate the fault."
    from w4a4_book import smem
    return {f"refused v{v} int4 pair 64-row R={R}": (cfg(tile_m=64, cluster_n=2, lora_rank=R), R)
            for v, cfg in ((1, smem.HopperV1Config), (2, smem.HopperV2Config)) for R in (32, 256)}


def cases() -> list:
    return [*gemm_cases(), *ACTIVATION_CASES]


def _unguarded(kernel_class):
    "`kernel_class.requirements` without the guard against 64-row pairs (for `refused_cases` only)."
    import dataclasses
    from w4a4_book.kernels.sm90_parts import Int4GemmBase
    plain = Int4GemmBase.requirements.__func__
    kernel_class.requirements = classmethod(lambda cls, cfg: plain(cls, dataclasses.replace(cfg, tile_m=128)))


def launch(case: str) -> None:
    "Run `case` once on the GPU at `SHAPE` and wait for it; raise if its output is not finite."
    import torch
    from w4a4_book import act_quant, registry, gemm
    from w4a4_book.bench import workloads
    M, N, K = SHAPE
    if case in ACTIVATION_CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
        smooth = (torch.rand(K, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
        down = torch.randn(32, K, generator=g, device="cuda").to(torch.bfloat16)
        _, lora_act = act_quant.quantize_lora_down(x, smooth, down, fmt=ACTIVATION_CASES[case])
        out = lora_act
    else:
        config, R = {**gemm_cases(), **refused_cases()}[case]
        if case in refused_cases(): _unguarded(registry.spec_for(config).kernel_class())
        w = workloads.make_workload(M, N, K, R, fmt=registry.spec_for(config).fmt)
        out = gemm.gemm_w4a4(*w.operands, out_dtype=w.out_dtype, config=config)
    torch.cuda.synchronize()
    if not torch.isfinite(out.float()).all(): raise SystemExit(f"{case}: output not finite")


def _run(cmd: list, timeout: int = LAUNCH_TIMEOUT_S) -> tuple:
    "`(returncode, stdout + stderr, seconds)` of `cmd` run from the checkout; a timeout is returncode None."
    t = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return r.returncode, r.stdout + r.stderr, time.time() - t
    except subprocess.TimeoutExpired as e:
        return None, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}", time.time() - t


def parse_sanitizer(text: str) -> dict:
    "compute-sanitizer's summary: `errors` from its ERROR SUMMARY, and racecheck's hazards, errors and warnings."
    out = {}
    m = re.search(r"ERROR SUMMARY: (\d+) errors?", text)
    out["errors"] = int(m.group(1)) if m else None
    m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    if m: out.update(hazards=int(m.group(1)), hazard_errors=int(m.group(2)), hazard_warnings=int(m.group(3)))
    return out


def sanitize_case(case: str, tool: str) -> dict:
    "One case under one compute-sanitizer tool: its summary, return code, time, and the first report lines."
    api = ["--report-api-errors", "no"] if tool == "memcheck" else []     # cuda-python's driver probes are not accesses
    cmd = ["compute-sanitizer", "--tool", tool, *api, "--print-limit", "10", sys.executable, __file__, "launch", case]
    rc, text, secs = _run(cmd)
    reports = [l for l in text.splitlines() if l.startswith("=========") and "SUMMARY" not in l][:12]
    return dict(case=case, tool=tool, returncode=rc, seconds=round(secs, 1), **parse_sanitizer(text), report=reports)


def run_sanitize(workers: int) -> list:
    "Every case once without a tool (compiling it into the disk cache), then under each tool, `workers` at a time."
    with ThreadPoolExecutor(workers) as pool:
        warm = dict(zip(cases(), pool.map(lambda c: _run([sys.executable, __file__, "launch", c]), cases())))
        bad = {c: r[1][-2000:] for c, r in warm.items() if r[0] != 0}
        if bad: print("launch failed without a tool:", bad, flush=True)
        jobs = [(c, t) for t in SANITIZERS for c in cases() if c not in bad]
        rows = list(pool.map(lambda ct: sanitize_case(*ct), jobs))
    for r in rows:
        print(f"{r['tool']:>9} {r['case']:<22} errors={r['errors']} rc={r['returncode']} {r['seconds']} s", flush=True)
    return rows + [dict(case=c, tool="none", returncode=warm[c][0], report=bad[c].splitlines()[-12:]) for c in bad]


def run_diagnose() -> list:
    "Each refused config launched once without a tool and once under memcheck: where its fault is."
    rows = []
    for c in refused_cases():
        rc, text, secs = _run([sys.executable, __file__, "launch", c])
        rows.append(dict(case=c, tool="none", returncode=rc, seconds=round(secs, 1), report=text.splitlines()[-8:]))
        rows.append(sanitize_case(c, "memcheck"))
        print(c, [(r["tool"], r["returncode"], r.get("errors")) for r in rows[-2:]], flush=True)
    return rows


def parse_junit(path: Path) -> dict:
    "Counts of a junit XML report and the node ids of the tests that failed or errored (the suite has no test classes)."
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [f"{c.get('classname').replace('.', '/')}.py::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return dict(**n, passed=n["tests"] - n["failures"] - n["errors"] - n["skipped"], failed=failed)


def run_suite(workers: int, junit: Path) -> list:
    "`pytest -m gpu` over `workers` processes (one where pytest-xdist is missing), then its failures again in one."
    import importlib.util
    spread = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 and importlib.util.find_spec("xdist") else []
    rc, text, secs = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", *spread, f"--junitxml={junit}"],
                          timeout=3600)
    print(text[-6000:], flush=True)
    rows = [dict(run="all", workers=workers if spread else 1, returncode=rc, seconds=round(secs), **parse_junit(junit))]
    if rows[0]["failed"]:
        again = junit.with_name(junit.stem + "_again.xml")
        rc, text, secs = _run([sys.executable, "-m", "pytest", "-q", "-rfE", f"--junitxml={again}", *rows[0]["failed"]],
                              timeout=3600)
        print(text[-6000:], flush=True)
        rows.append(dict(run="failed again, one process", workers=1, returncode=rc, seconds=round(secs),
                         **parse_junit(again)))
    return rows


RECORDS = {"moves": lambda out, gpu: ["repro", "lora-bug", "--moves", "--out", str(out / f"lora_bug_{gpu}_moves.json")],
           "ladder": lambda out, gpu: ["repro", "ladder", "--fmt", "int4_pg",
                                       "--out", str(out / f"ladder_{gpu}_int4_pg.json")]}


def run_records(out_dir: Path, which=tuple(RECORDS)) -> None:
    "`w4a4-book repro lora-bug --moves` and `w4a4-book repro ladder --fmt int4_pg` (those of `which`), into `out_dir`."
    import torch
    from w4a4_book.cli import main as cli
    gpu = torch.cuda.get_device_name().split()[1].lower()          # "h200", "h100"
    for name in which:
        argv = RECORDS[name](out_dir, gpu)
        print("w4a4-book", *argv[:-2], flush=True)
        if cli(argv): raise SystemExit(f"w4a4-book {' '.join(argv)} failed")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("suite", "sanitize"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--workers", type=int, default=8 if name == "suite" else 6)
    sub.add_parser("diagnose").add_argument("--out", type=Path, required=True)
    sub.add_parser("launch").add_argument("case", choices=[*cases(), *refused_cases()])
    p = sub.add_parser("records")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--only", nargs="+", choices=list(RECORDS), default=list(RECORDS))
    a = ap.parse_args(argv)
    if a.what == "launch":
        launch(a.case)
        return 0
    if a.what == "records":
        run_records(a.out_dir, a.only)
        return 0
    from w4a4_book.records import provenance, save_record
    if a.what == "suite":
        with tempfile.TemporaryDirectory(prefix="gpu_suite-") as d:     # two suites at once never share a report
            rows = run_suite(a.workers, Path(d) / "gpu_suite.xml")
        shapes = [["pytest -m gpu"]]
    elif a.what == "diagnose":
        rows, shapes = run_diagnose(), [list(SHAPE)]
    else:
        rows = run_sanitize(a.workers)
        shapes = [list(SHAPE)]
    workers = f" --workers {a.workers}" if a.what != "diagnose" else ""
    command = f"python tools/gpu_checks.py {a.what} --out nbs/data/{a.out.name}{workers}"
    print(f"saved {save_record(a.out, provenance(command, shapes, kind=f'gpu_{a.what}'), rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
