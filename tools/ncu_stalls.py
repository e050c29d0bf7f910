"""Profile one W4A4 kernel launch with Nsight Compute and save where its warps' cycles go, as a record.

    python tools/ncu_stalls.py --version v2 --shape 4352 3072 3840 32 --out nbs/data/ncu_h200_v2.json
    python tools/ncu_stalls.py --roles --version v2 --shape 4352 3072 3840 32 --out nbs/data/ncu_roles_h200_v2.json

With `--roles` the record holds, per warp role, where that role's warps were sampled (ncu's per-instruction
warp-state samples, from the source page) and how many instructions each of its warps executes per K-block.
A role is the code between two `setmaxnreg` instructions, named by the register count it sets (v2's
`WarpRoles` says which); code before the first is `setup`, and a kernel without `setmaxnreg` (v1) is one role,
`all`.

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

def parse_source(text):
    "ncu's `--page source --csv --print-source sass` as a list of per-instruction dicts (numbers as floats)."
    lines = text[text.index('"Address"'):]
    out = []
    for r in csv.DictReader(io.StringIO(lines)):
        row = {}
        for k, v in r.items():
            try:
                row[k] = float(v.replace(",", "")) if k not in ("Address", "Source") else v
            except (ValueError, AttributeError):
                row[k] = v
        out.append(row)
    return out

def _regs(src):
    "The register count a `setmaxnreg` SASS instruction sets (USETMAXREG ... 0xe0), else None."
    if "USETMAXREG" not in src: return None
    return int(src.split(",")[-1].split()[-1].rstrip(";"), 16)

def kernel_roles(kernel):
    "`{setmaxnreg count: (role, warps)}` of a v2 kernel object (its `WarpRoles`), or `{None: ('all', warps)}` for v1."
    r = getattr(kernel, "roles", None)
    if r is None: return {None: ("all", kernel.threads // 32)}
    return {r.load_regs: ("load", 4), r.decode_regs: ("decode", len(r.decode_warps)), r.mma_regs: ("mma", len(r.mma_warps))}

def by_role(instrs, k_blocks_per_cta, ctas, roles_by_regs):
    """Attribute per-instruction samples to warp roles (`roles_by_regs` as from `kernel_roles`). Returns
    {role: {metric: value}}: the role's share of all samples, instructions per warp per K-block, the share of its
    samples spent waiting on an mbarrier (the try-wait, its back-off sleep and the retry branch), and its samples
    by stall reason (each % of the role's samples)."""
    warps = dict(roles_by_regs.values())
    role, roles = ("setup" if any(_regs(i["Source"]) for i in instrs) else roles_by_regs[None][0]), {}
    stall_keys = [k for k in instrs[0] if k.startswith("stall_") and "Not Issued" not in k]
    prev = ""
    for i in instrs:
        r = _regs(i["Source"])
        if r is not None:
            role = roles_by_regs[r][0] if r in roles_by_regs else f"regs{r}"
        d = roles.setdefault(role, {"samples": 0.0, "executed": 0.0, "mbarrier": 0.0, **{k: 0.0 for k in stall_keys}})
        n = i.get("Warp Stall Sampling (All Samples)") or 0.0
        d["samples"] += n
        d["executed"] += i.get("Instructions Executed") or 0.0
        src = i["Source"]
        if "SYNCS.PHASECHK" in src or "NANOSLEEP" in src or ("BRA" in src and ("NANOSLEEP" in prev or "SYNCS.PHASECHK" in prev)):
            d["mbarrier"] += n
        for k in stall_keys:
            d[k] += i.get(k) or 0.0
        prev = src
    total = sum(d["samples"] for d in roles.values()) or 1.0
    out = {}
    for role, d in roles.items():
        s = d["samples"] or 1.0
        m = {"samples (% of all)": 100 * d["samples"] / total,
             "instructions per warp per K-block": d["executed"] / (ctas * warps.get(role, 1) * k_blocks_per_cta),
             "waiting on an mbarrier (%)": 100 * d["mbarrier"] / s}
        m.update({f"stall: {k[6:]} (%)": 100 * d[k] / s for k in stall_keys})
        out[role] = m
    return out

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", choices=("v1", "v2"), default="v2")
    ap.add_argument("--shape", nargs=4, type=int, default=[4352, 3072, 3840, 32], metavar=("M", "N", "K", "R"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--roles", action="store_true", help="per-role samples from the source page (see the docstring)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.version, a.shape)
    def profile(extra):
        return subprocess.run(ncu_command(a, "--csv", "--page", "details", *[x for s in SECTIONS for x in ("--section", s)],
                                          *extra), capture_output=True, text=True)
    if a.roles:
        return roles_main(a)
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

def ncu_command(a, *options):
    "ncu with `options`, profiling the last of this script's child launches for `a.version` and `a.shape`."
    return ["ncu", "--kernel-name", "regex:kernel_cutlass_kernel_w4a4", "--launch-skip", str(WARMUP), "--launch-count", "1",
            *options, sys.executable, __file__, "--child", "--version", a.version, "--shape", *map(str, a.shape), "--out", "-"]

def roles_main(a):
    "`--roles`: profile with source counters, attribute them to roles, save the record."
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        rep = os.path.join(d, "rep")
        res = subprocess.run(ncu_command(a, "--section", "SourceCounters", "--section", "WarpStateStats", "-f", "-o", rep),
                             capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"ncu failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
        src = subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                             capture_output=True, text=True, check=True).stdout
    M, N, K, R = a.shape
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from w4a4_book.records import provenance, save_record
    from w4a4_book.sm90 import build_kernel, Problem
    kern, _ = build_kernel(a.version, Problem(M, N, K, R))
    tiles = -(-M // kern.bm) * (N // kern.bn)
    ctas = min(tiles, getattr(kern, "num_sms", tiles))                # v2 is persistent; v1 runs one CTA per tile
    k_blocks = tiles * (K // kern.bk) / ctas
    roles = by_role(parse_source(src), k_blocks, ctas, kernel_roles(kern))
    ncu_version = subprocess.run(["ncu", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    command = "python tools/ncu_stalls.py " + shlex.join(["--roles", "--version", a.version, "--shape", *map(str, a.shape), "--out", str(a.out)])
    prov = provenance(command, [a.shape], kind="ncu-roles", version=a.version, ncu=ncu_version,
                      k_blocks_per_cta=k_blocks, ctas=ctas)
    rows = [dict(role=r, metric=m, value=v) for r, d in roles.items() for m, v in d.items()]
    print(f"saved {save_record(a.out, prov, rows)}")

if __name__ == "__main__":
    sys.exit(main())
