"""Profile one W4A4 kernel launch with Nsight Compute and save where its warps' cycles go, as a record.

    python tools/ncu_stalls.py --kernel v2 --shape 4352 3072 3840 32 --out nbs/data/ncu_h200_v2.json
    python tools/ncu_stalls.py --roles --kernel v2 --shape 4352 3072 3840 32 --out nbs/data/ncu_roles_h200_v2.json

`--kernel` is a kernel's name in the registry of `w4a4_book.gemm` (default: the format's default kernel), run with
its config at every default, `registry.find_kernel(name).config()`. Records made before the registry existed name it
with `--version`, which is still accepted, and every record keeps the name in its `version` field.

With `--roles` the record holds, per warp role, where that role's warps were sampled (ncu's per-instruction
warp-state samples, from the source page) and how many instructions each of its warps executes per K-block.
A role is the code between two `setmaxnreg` instructions, named by the register count it sets (v2's
`WarpRoles` says which); code before the first is `setup`, and a kernel without `setmaxnreg` (v1) is one role,
`all`.

With `--activation` it profiles the activation side instead, at `M` and `K` of `--shape` (N unused): the kernels
`act_quant.quantize_lora_down` launches for `--fmt` (int4: one; int4_pg and int8: two passes), or with `--one-pass C` the
one-pass kernel at a cluster of C CTAs (`act_quant.quantize_rows_one_pass`); the record holds every kernel's metrics, in
launch order, with the activation sections below (memory and occupancy as well).

    python tools/ncu_stalls.py --activation --fmt int4_pg --shape 4352 0 3840 32 --out nbs/data/ncu_h200_act_pg_k3840.json

Needs an sm_90 GPU and `ncu` on the PATH. The kernel is launched a few times to warm up; ncu profiles the
last launch with the sections below (it replays the kernel once per counter pass). The record keeps every
metric ncu printed, by section, with the provenance of `w4a4_book.records`.
"""
import argparse, csv, io, os, shlex, subprocess, sys
from pathlib import Path

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "SchedulerStats", "WarpStateStats",
            "InstructionStats", "SourceCounters")
ACT_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "SchedulerStats", "WarpStateStats",
                "Occupancy", "LaunchStats")
DETAILS = ("--print-details", "all")   # also the metrics behind each section's charts: stall reasons, pipe shares
WARMUP = 3

def kernel_config(name, fmt="int4", shape=None, sets=()):
    """The registry's kernel `name` (None: the format's default kernel) for `fmt` as `(spec, config)`: its config at
    every default, with the tile the library picks for `shape` where the kernel has a choice (`heuristics.tile_choice`),
    then the fields `sets` names (`NAME=VALUE` strings; a value is an int unless the field's default is a string)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dataclasses import fields, replace
    from w4a4_book import heuristics, jit, registry
    spec = registry.find_kernel(name, fmt)
    config = spec.config()
    config = config if shape is None else heuristics.tile_choice(config, jit.example_problem(spec, *shape))
    strings = {f.name: isinstance(f.default, str) for f in fields(config)}   # the others are ints (or None by default)
    for s in sets:
        field, _, value = s.partition("=")
        if field not in strings or not value or not (strings[field] or value.isdigit()):
            sys.exit(f"--set {s!r}: expected NAME=VALUE with NAME a field of {type(config).__name__} and an int for its "
                     f"int fields: {sorted(strings)}")
        config = replace(config, **{field: value if strings[field] else int(value)})
    return spec, config

def child(name, fmt, shape, activation=False, one_pass=None, sets=()):
    "Runs inside ncu: build one workload and launch the kernel `name` (or the activation side) WARMUP + 1 times."
    import torch
    from w4a4_book import gemm
    from w4a4_book.bench.workloads import make_workload
    if activation:
        launch = activation_call(fmt, shape, one_pass)
    else:
        _, config = kernel_config(name, fmt, shape, sets)
        w = make_workload(*shape, fmt=fmt)
        launch, _ = gemm.gemm_launcher(*w.operands, out_dtype=w.out_dtype, config=config)
    for _ in range(WARMUP + 1):
        launch()
    torch.cuda.synchronize()

def parse_kernels(text):
    "ncu's `--csv` details page as a list, one per profiled launch in order: `(kernel name, {section: {metric (unit): value}})`."
    launches = {}
    for r in csv.DictReader(io.StringIO(text[text.index('"ID"'):])):
        name = r["Metric Name"] + (f" ({r['Metric Unit']})" if r["Metric Unit"] else "")
        value = r["Metric Value"].replace(",", "")
        try:
            value = float(value)
        except ValueError:
            pass
        kernel, metrics = launches.setdefault(r["ID"], (r["Kernel Name"], {}))
        metrics.setdefault(r["Section Name"], {})[name] = value
    return list(launches.values())

def parse(text):
    "ncu's `--csv` details page of one launch as `({section: {metric (unit): value}}, kernel name)`."
    launches = parse_kernels(text)
    return (launches[0][1], launches[0][0]) if launches else ({}, None)

def activation_call(fmt, shape, one_pass=None):
    """The activation side on seeded inputs of `shape`'s M, K and R: `act_quant.quantize_lora_down` for `fmt`, or with
    `one_pass` (a cluster size) `act_quant.quantize_rows_one_pass`."""
    from w4a4_book import act_quant
    from w4a4_book.bench.layer import _activation_inputs
    M, _, K, R = shape
    x, smooth, ldt = _activation_inputs(M, K, R)
    if one_pass:
        return lambda: act_quant.quantize_rows_one_pass(x, smooth, ldt, fmt=fmt, cluster=one_pass)
    return lambda: act_quant.quantize_lora_down(x, smooth, ldt, fmt=fmt)

def activation_launches(fmt, one_pass=None) -> int:
    "Kernels one `activation_call` launches: one for int4 or one pass, two passes for int4_pg and int8."
    return 1 if one_pass or fmt == "int4" else 2

def _one_pass_args(a) -> list:
    "`--one-pass C` as given (none without it), for the child's command line and the record's."
    return ["--one-pass", str(a.one_pass)] if a.one_pass else []

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
    out = {r.load_regs: ("load", r.first_worker_warp)}   # every warp below the first worker warp sets `load_regs`
    if r.decode_warps: out[r.decode_regs] = ("decode", len(r.decode_warps))
    return {**out, r.mma_regs: ("mma", len(r.mma_warps))}

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

def parser():
    "The options: which kernel, which shape, where the record goes, and `--roles`."
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default=None, help="the kernel's registry name, e.g. v1 or v2 (default: the default kernel)")
    ap.add_argument("--version", dest="kernel", help=argparse.SUPPRESS)   # the older records' spelling of --kernel
    ap.add_argument("--fmt", default="int4", help="the weights' format, e.g. int4 or int4_pg (default: int4)")
    ap.add_argument("--shape", nargs=4, type=int, default=[4352, 3072, 3840, 32], metavar=("M", "N", "K", "R"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--roles", action="store_true", help="per-role samples from the source page (see the docstring)")
    ap.add_argument("--activation", action="store_true", help="profile the activation side's kernels (see the docstring)")
    ap.add_argument("--one-pass", type=int, default=None, metavar="C", help="with --activation: the one-pass kernel, a cluster of C")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                    help="a config field set after the library's choice, e.g. tile_m=256 (repeatable)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap

def main(argv=None):
    "Profile the kernel `argv` names and save the record; with `--child`, be the process ncu profiles."
    a = parser().parse_args(argv)
    if a.one_pass is not None and not a.activation:
        sys.exit("--one-pass: only with --activation")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout's w4a4_book
    if a.activation:                                          # no GEMM kernel: the activation side's own kernels
        a.kernel = "activation"
        return child(a.kernel, a.fmt, a.shape, True, a.one_pass) if a.child else activation_main(a)
    spec, config = kernel_config(a.kernel, a.fmt, a.shape, a.sets)   # an unknown name, format or field fails here, naming it
    a.kernel = spec.kernel
    if a.child:
        return child(a.kernel, a.fmt, a.shape, sets=a.sets)
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
    rows = [dict(section=s, metric=m, value=v) for s, d in metrics.items() for m, v in d.items()]
    save_profile(a, ["--kernel", a.kernel, *_fmt_arg(a), *_set_args(a), "--shape", *map(str, a.shape)], rows, kind="ncu", version=a.kernel,
                 fmt=a.fmt, config=repr(config), sections=list(SECTIONS), kernel=kernel)

def save_profile(a, args, rows, **fields):
    """Save `rows` as the record `a.out`, its provenance naming the command that re-measures it (this script with
    `args` and the stored `--out`), the ncu version and `fields`."""
    from w4a4_book.records import provenance, save_record
    ncu_version = subprocess.run(["ncu", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    command = "python tools/ncu_stalls.py " + shlex.join([*args, "--out", _out_arg(a.out)])
    print(f"saved {save_record(a.out, provenance(command, [a.shape], ncu=ncu_version, **fields), rows)}")

def _fmt_arg(a) -> list:
    "`--fmt` for a stored command, left out for int4 so that the older records' commands stay as they were."
    return [] if a.fmt == "int4" else ["--fmt", a.fmt]

def _set_args(a) -> list:
    "`--set NAME=VALUE` as given, for the child's command line and the record's."
    return [x for s in a.sets for x in ("--set", s)]

def _out_arg(out: Path) -> str:
    "The `--out` of the stored command: relative to the checkout when inside it, else `nbs/data/` and the file name."
    try:
        return str(out.resolve().relative_to(Path(__file__).resolve().parent.parent))
    except ValueError:
        return f"nbs/data/{out.name}"


def ncu_command(a, *options, launches=1):
    """ncu with `options`, profiling the last of this script's child calls for `a.kernel` and `a.shape` (or the
    activation side's), a call being `launches` kernel launches."""
    return ["ncu", "--kernel-name", "regex:kernel_cutlass_kernel_w4a4", "--launch-skip", str(WARMUP * launches),
            "--launch-count", str(launches), *options, sys.executable, __file__, "--child", "--kernel", a.kernel, "--fmt", a.fmt,
            "--shape", *map(str, a.shape), *["--activation"] * a.activation, *_one_pass_args(a), *_set_args(a), "--out", "-"]

def activation_main(a):
    "`--activation`: profile one call of the activation side (every kernel it launches) and save the record."
    res = subprocess.run(ncu_command(a, "--csv", "--page", "details", *[x for s in ACT_SECTIONS for x in ("--section", s)],
                                     *DETAILS, launches=activation_launches(a.fmt, a.one_pass)), capture_output=True, text=True)
    if res.returncode or '"ID"' not in res.stdout:
        sys.exit(f"ncu failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    kernels = parse_kernels(res.stdout)
    rows = [dict(launch=i, kernel=k, section=s, metric=m, value=v)
            for i, (k, metrics) in enumerate(kernels) for s, d in metrics.items() for m, v in d.items()]
    save_profile(a, ["--activation", "--fmt", a.fmt, *_one_pass_args(a), "--shape", *map(str, a.shape)], rows,
                 kind="ncu-activation", fmt=a.fmt, one_pass=a.one_pass, sections=list(ACT_SECTIONS), kernels=[k for k, _ in kernels])

def launched_ctas(kern, M, N):
    "CTAs the kernel object `kern` launches for an `M`×`N` output: one per tile (v1), or its persistent scheduler's grid (v2)."
    tiles = -(-M // kern.bm) * (N // kern.bn)
    sched = getattr(kern, "Scheduler", None)
    if sched is None:
        return tiles
    mc = kern.cluster_n
    return sched(-(-M // kern.bm), N // (kern.bn * mc), mc).clusters(kern.num_sms) * mc

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
    import torch
    from w4a4_book import cache, jit
    spec, config = kernel_config(a.kernel, a.fmt, a.shape, a.sets)
    kern, _ = jit.build(config, jit.example_problem(spec, *a.shape), cache.sm_count(torch.cuda.current_device()))   # the grid that ran
    M, N, K, R = a.shape
    tiles = -(-M // kern.bm) * (N // kern.bn)
    ctas = launched_ctas(kern, M, N)
    k_blocks = tiles * (K // kern.bk) / ctas
    roles = by_role(parse_source(src), k_blocks, ctas, kernel_roles(kern))
    rows = [dict(role=r, metric=m, value=v) for r, d in roles.items() for m, v in d.items()]
    save_profile(a, ["--roles", "--kernel", a.kernel, *_fmt_arg(a), *_set_args(a), "--shape", *map(str, a.shape)], rows, kind="ncu-roles",
                 version=a.kernel, fmt=a.fmt, config=repr(config), k_blocks_per_cta=k_blocks, ctas=ctas)

if __name__ == "__main__":
    sys.exit(main())
