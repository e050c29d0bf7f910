"""Profile one W4A4 kernel launch with Nsight Compute and save where its warps' cycles go, as a record.

    python tools/ncu_stalls.py --version v2 --shape 4352 3072 3840 32 --out nbs/data/ncu_h200_v2.json

Needs an sm_90 GPU and `ncu` on the PATH. The kernel is launched a few times to warm up; ncu profiles the
last launch with the sections below (it replays the kernel once per counter pass). The record keeps every
metric ncu printed, by section, with the provenance of `w4a4_book.records`.
"""
import argparse, csv, io, os, shlex, subprocess, sys
from pathlib import Path

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "SchedulerStats", "WarpStateStats", "InstructionStats",
            "SourceCounters")
DETAILS = ("--print-details", "all")   # also the metrics behind each section's charts: stall reasons, pipe shares
WARMUP = 3

def child(version, shape):
    "Runs inside ncu: build one problem and launch the kernel WARMUP + 1 times."
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from w4a4_book.bench import make_problem
    from w4a4_book.sm90 import gemm_launcher
    p = make_problem(*shape)
    launch, _ = gemm_launcher(*p.operands, version=version)
    for _ in range(WARMUP + 1):
        launch()
    torch.cuda.synchronize()

def parse(text):
    "ncu's `--csv` details page as {section: {metric (unit): value}}."
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    out = {}
    for r in rows:
        name = r["Metric Name"] + (f" ({r['Metric Unit']})" if r["Metric Unit"] else "")
        value = r["Metric Value"].replace(",", "")
        try:
            value = float(value)
        except ValueError:
            pass
        out.setdefault(r["Section Name"], {})[name] = value
    return out, rows[0]["Kernel Name"] if rows else None

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", choices=("v1", "v2"), default="v2")
    ap.add_argument("--shape", nargs=4, type=int, default=[4352, 3072, 3840, 32], metavar=("M", "N", "K", "R"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.version, a.shape)
    def profile(extra):
        cmd = ["ncu", "--csv", "--page", "details", "--kernel-name", "regex:kernel_cutlass_kernel_w4a4",
               "--launch-skip", str(WARMUP), "--launch-count", "1", *[x for s in SECTIONS for x in ("--section", s)],
               *extra,
               sys.executable, __file__, "--child", "--version", a.version, "--shape", *map(str, a.shape), "--out", "-"]
        return subprocess.run(cmd, capture_output=True, text=True)
    res = profile(DETAILS)
    if res.returncode or '"ID"' not in res.stdout:     # an ncu without --print-details: the section bodies alone
        print(f"ncu {' '.join(DETAILS)} failed ({res.returncode}): {res.stderr.strip()[-500:]}", file=sys.stderr)
        res = profile(())
    if res.returncode or '"ID"' not in res.stdout:
        sys.exit(f"ncu failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    metrics, kernel = parse(res.stdout)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from w4a4_book.records import provenance, save_record
    ncu_version = subprocess.run(["ncu", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    command = "python tools/ncu_stalls.py " + shlex.join(["--version", a.version, "--shape", *map(str, a.shape), "--out", str(a.out)])
    prov = provenance(command, [a.shape], kind="ncu", version=a.version, ncu=ncu_version, sections=list(SECTIONS),
                      kernel=kernel)
    rows = [dict(section=s, metric=m, value=v) for s, d in metrics.items() for m, v in d.items()]
    print(f"saved {save_record(a.out, prov, rows)}")

if __name__ == "__main__":
    sys.exit(main())
