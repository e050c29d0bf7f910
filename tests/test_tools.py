"""The probes, the GEMM variants and the checks of a commit, on CPU: ncu's pages parsed, the kernel and roles a profile
names, and each GPU path end to end with the GPU's parts stood in for (the measurements themselves need a GPU)."""
import shlex
import subprocess
import sys

import pytest
import torch

from w4a4_book import act_quant, checks, gemm, heuristics, jit, registry
from w4a4_book.bench import variants
from w4a4_book.operands import Problem
from w4a4_book.probes import clock, decode, host, ncu
from w4a4_book.probes.__main__ import PROBES, main as probes_main, probe_parser
from w4a4_book.records import data_dir, list_records, load_record, remeasure
from w4a4_book.configs import HopperV1Config, HopperV2Config

CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","127.0.0.1","kernel_cutlass_kernel_w4a4_x","1","7","(512, 1, 1)","(132, 1, 1)","0","9.0","SchedulerStats","Issue Slots Busy","%","61.20"
"0","1","python3","127.0.0.1","kernel_cutlass_kernel_w4a4_x","1","7","(512, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","","1,234.5"
"0","1","python3","127.0.0.1","kernel_cutlass_kernel_w4a4_x","1","7","(512, 1, 1)","(132, 1, 1)","0","9.0","SpeedOfLight","Memory Throughput","","n/a"
'''




def test_parse_details_csv():
    metrics, kernel = ncu.parse_details(CSV)
    assert kernel == "kernel_cutlass_kernel_w4a4_x"
    assert metrics["SchedulerStats"] == {"Issue Slots Busy (%)": 61.2}
    assert metrics["Command line profiler metrics"]["smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"] == 1234.5
    assert metrics["SpeedOfLight"]["Memory Throughput"] == "n/a"


def test_parse_details_of_two_launches():
    "The activation side's two passes: each launch's metrics apart, in launch order, named by its kernel."
    second = CSV.splitlines()[2].replace('"0","1"', '"1","1"', 1).replace("w4a4_x", "w4a4_y").replace("61.20", "12.50")
    launches = ncu.parse_kernels(CSV + second + "\n")
    assert [k for k, _ in launches] == ["kernel_cutlass_kernel_w4a4_x", "kernel_cutlass_kernel_w4a4_y"]
    assert launches[1][1] == {"SchedulerStats": {"Issue Slots Busy (%)": 12.5}}
    assert ncu.parse_details(CSV)[0] == launches[0][1]


def _ncu_args(*argv):
    return probe_parser().parse_args(["ncu", *argv])


def test_activation_profile_command():
    "`--activation` profiles every kernel of the last call (two for int4_pg's passes), and `--one-pass` only with it."
    a = _ncu_args("--activation", "--fmt", "int4_pg", "--shape", "4352", "0", "3840", "32", "--out", "x.json")
    a.kernel = "activation"
    assert [ncu.activation_launches(f, c) for f, c in (("int4_pg", None), ("int8", None), ("int4", None), ("int4_pg", 16))] == [2, 2, 1, 1]
    cmd = ncu.ncu_command(a, launches=ncu.activation_launches(a.fmt, a.one_pass))
    assert cmd[cmd.index("--launch-skip") + 1] == str(2 * ncu.WARMUP) and cmd[cmd.index("--launch-count") + 1] == "2"
    assert cmd[cmd.index(sys.executable):cmd.index("--child")] == [sys.executable, "-m", "w4a4_book.probes", "ncu"]
    assert "--activation" in cmd and "--one-pass" not in cmd
    with pytest.raises(ValueError, match="--one-pass: only with --activation"):
        probes_main(["ncu", "--one-pass", "4", "--out", "x.json"])


SOURCE = '''"Kernel Name","kernel_cutlass_kernel_w4a4_x",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_selected","stall_long_sb (Not Issued)"
"0x10","      LDC R1, c[0x0][0x28]","2","8","0","2","0"
"0x20","      USETMAXREG.DEALLOC.CTAPOOL 0x18","0","4","0","0","0"
"0x30","      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R4","6","40","6","0","6"
"0x40","@!P0  NANOSLEEP.SYNCS 0x989680","2","10","2","0","2"
"0x50","@!P0  BRA 0x30","2","10","0","2","0"
"0x60","      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0","0","8","0","0","0"
"0x70","      FFMA R1, R2, R3, R1","8","1,600","0","8","0"
'''


def test_source_samples_by_role():
    "Each setmaxnreg starts a role named by its register count; mbarrier waits are the try-wait, its sleep and retry."
    ins = ncu.parse_source(SOURCE)
    assert [i["Address"] for i in ins] == ["0x10", "0x20", "0x30", "0x40", "0x50", "0x60", "0x70"]
    assert ins[-1]["Instructions Executed"] == 1600.0
    roles = ncu.by_role(ins, k_blocks_per_cta=10, ctas=2, roles_by_regs={24: ("load", 4), 224: ("mma", 8)})
    assert set(roles) == {"setup", "load", "mma"}
    assert roles["load"]["samples (% of all)"] == 50.0 and roles["mma"]["samples (% of all)"] == 40.0
    assert roles["load"]["waiting on an mbarrier (%)"] == 100.0 and roles["mma"]["waiting on an mbarrier (%)"] == 0.0
    assert roles["load"]["stall: long_sb (%)"] == 80.0
    assert roles["mma"]["instructions per warp per K-block"] == 1608 / (2 * 8 * 10)
    assert "stall: long_sb (Not Issued) (%)" not in roles["mma"]


def test_roles_come_from_the_kernel():
    "v2's role names and warp counts are its WarpRoles'; v1 is one role of all its warps."
    v2, _ = jit.build(HopperV2Config(), Problem(256, 256, 256, 16))
    v1, _ = jit.build(HopperV1Config(), Problem(256, 256, 256, 16))
    r = v2.roles
    assert ncu.kernel_roles(v2) == {r.load_regs: ("load", 4), r.decode_regs: ("decode", 4), r.mma_regs: ("mma", 8)}
    assert ncu.kernel_roles(v1) == {None: ("all", 8)}


def test_kernel_is_a_registry_name():
    "`--kernel` names a registry row, run with its config at every default; no name is the default kernel."
    assert ncu.ncu_kernel_config("v1")[1] == HopperV1Config()
    assert ncu.ncu_kernel_config("v2")[1] == HopperV2Config()
    spec, config = ncu.ncu_kernel_config(None)
    assert spec.kernel == registry.find_kernel(fmt="int4").kernel and config == registry.default_config("int4")   # the probe's int4
    with pytest.raises(ValueError, match="kernel"):
        ncu.ncu_kernel_config("v3")


def test_int4_pg_kernel_and_roles():
    "`--fmt int4_pg` names the exact-integer kernel with the tile the library picks for the shape; it has no decode role."
    spec, config = ncu.ncu_kernel_config(None, "int4_pg", (4352, 3072, 10240, 128))
    assert spec.fmt == "int4_pg" and config == registry.default_config("int4_pg", problem=jit.example_problem(spec, 4352, 3072, 10240, 128))
    kern, _ = jit.build(config, jit.example_problem(spec, 4352, 3072, 10240, 128))
    r = kern.roles
    assert ncu.kernel_roles(kern) == {r.load_regs: ("load", r.first_worker_warp), r.mma_regs: ("mma", len(r.mma_warps))}
    assert ncu._fmt_arg(_ncu_args("--fmt", "int4_pg", "--out", "x.json")) == ["--fmt", "int4_pg"]
    assert ncu._fmt_arg(_ncu_args("--out", "x")) == []


@pytest.mark.parametrize("path", list_records("ncu"), ids=lambda p: p.name)
def test_recorded_commands_still_parse(path):
    """Every ncu record's re-measure command (the record names `tools/ncu_stalls.py`, written with `--version` before the
    registry) parses to the kernel its `version` field names; an activation profile's, to its format and cluster."""
    prov, _ = load_record(path)
    command = shlex.split(remeasure(prov))
    assert command[:4] == ["python", "-m", "w4a4_book.probes", "ncu"]
    args = probe_parser().parse_args(command[3:])
    if prov["kind"] == "ncu-activation":
        assert args.activation and (args.fmt, args.one_pass) == (prov["fmt"], prov["one_pass"])
        return
    assert ncu.ncu_kernel_config(args.kernel, args.fmt, sets=args.sets)[0].kernel == prov["version"]
    assert args.roles == (prov["kind"] == "ncu-roles")


def test_grid_matches_the_recorded_roles():
    "The CTAs and K-blocks per CTA the role attribution divides by are those of the recorded profiles (H200: 132 SMs)."
    for v in ("v1", "v2"):
        prov, _ = load_record(data_dir() / f"ncu_roles_h200_{v}.json")
        M, N, K, R = prov["shapes"][0]
        kern, _ = jit.build(ncu.ncu_kernel_config(prov["version"])[1], Problem(M, N, K, R), heuristics.DEFAULT_NUM_SMS)
        ctas = ncu.launched_ctas(kern, M, N)
        assert ctas == prov["ctas"], v
        assert -(-M // kern.bm) * (N // kern.bn) * (K // kern.bk) / ctas == prov["k_blocks_per_cta"], v


def test_config_fields_set_after_the_choice():
    "`--set NAME=VALUE` overrides a field after the library's tile choice, travels to the child, and a bad one is refused by name."
    _, cfg = ncu.ncu_kernel_config("v2", "int4_pg", [4352, 3072, 3840, 32], ["tile_m=256", "epi_vectors=smem", "stages=3"])
    assert (cfg.tile_m, cfg.epi_vectors, cfg.stages) == (256, "smem", 3)
    cmd = ncu.ncu_command(_ncu_args("--kernel", "v2", "--fmt", "int4_pg", "--set", "tile_m=256", "--out", "x.json"))
    assert cmd[cmd.index("--set") + 1] == "tile_m=256"
    for bad in ("tile=256", "tile_m=x", "tile_m"):
        with pytest.raises(ValueError, match="--set"):
            ncu.ncu_kernel_config("v2", "int4_pg", None, [bad])


@pytest.fixture
def saved(monkeypatch):
    "The record a run saves, kept here: provenance (its command alone) and rows; CUDA's synchronize a no-op."
    out = {}
    for module in (variants, clock, decode, host, ncu):
        monkeypatch.setattr(module, "provenance", lambda command, *a, **k: dict(command=command))
        monkeypatch.setattr(module, "save_record", lambda path, prov, rows: out.update(prov=prov, rows=rows) or path)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return out


def _bench_gemm(*argv):
    import argparse
    p = argparse.ArgumentParser()
    variants.add_arguments(p)
    return variants.run(p.parse_args(list(argv)))


@pytest.mark.parametrize("name", [n for n, v in variants.VARIANTS.items() if v.configs is not None])
def test_gemm_variants_run_on_stand_ins(name, monkeypatch, tmp_path, saved):
    "`bench-gemm --variants NAME` end to end, the GPU's parts (workload, launch, timer) stood in for: every row saved."
    stand_in = type("W", (), {"operands": (), "out_dtype": torch.bfloat16})
    monkeypatch.setattr(variants, "kernel_unavailable", lambda: None)
    monkeypatch.setattr(variants, "make_workload", lambda *a, **k: stand_in())
    monkeypatch.setattr(gemm, "gemm_launcher", lambda *a, **k: ((lambda: None), torch.zeros(2, 2)))
    monkeypatch.setattr(variants, "time_cuda", lambda f, **k: dict(median_ms=0.1, p10_ms=0.1, p90_ms=0.1, n=k["iters"]))
    assert _bench_gemm("--variants", name, "--out", str(tmp_path / "r.json"), "--iters", "25") == 0
    v = variants.VARIANTS[name]
    assert len(saved["rows"]) == sum(len(v.configs(*s, 32)) for s in v.shapes)
    assert all(r[f] for r in saved["rows"] for f in (*v.same, *v.equals))
    assert saved["prov"]["command"] == f"w4a4-book bench-gemm --variants {name} --out nbs/data/r.json --iters 25"


def test_stream_k_layer_runs_on_stand_ins(monkeypatch, tmp_path, saved):
    "The layer variant end to end: its int4_pg layer found in the library's path, copied onto stream-K, both timed."
    class Layer:
        kernel_config = None
        def __call__(self, x): return x * 2
    def paths(M, K, N, R):
        pg, x = Layer(), torch.ones(2, 2)
        return dict(torch_bf16=lambda: None, torch_fp8_compiled=lambda: None, w4a4_pg=lambda: pg(x)), None
    monkeypatch.setattr(variants, "kernel_unavailable", lambda: None)
    monkeypatch.setattr(variants, "layer_paths", paths)
    monkeypatch.setattr(variants, "time_cuda", lambda f, **k: dict(median_ms=0.1, p10_ms=0.1, p90_ms=0.1, n=k["iters"]))
    assert _bench_gemm("--variants", "stream_k_layer", "--out", str(tmp_path / "l.json")) == 0
    rows = saved["rows"]
    assert len(rows) == 4 and all(r["same_output"] and r["w4a4_pg_stream_k_ms"] == 0.1 for r in rows)
    assert saved["prov"]["command"] == "w4a4-book bench-gemm --variants stream_k_layer --out nbs/data/l.json"


def test_gpu_clocks_runs_on_stand_ins(monkeypatch, tmp_path, saved):
    "The `gpu-clocks` probe end to end with `nvidia-smi` and the GEMMs stood in for: a row per GEMM and shape, idle samples left out."
    lines = "1650, 1980, 690.5, 700.00, 60, 0x0000000000000004\n1700, 1980, 650.0, 700.00, 61, 0x0000000000000000\n345, 1980, 80.0, 700.00, 50, 0x0000000000000001\n"

    class Smi:
        def __init__(self, cmd, **k): assert cmd[0] == "nvidia-smi" and "-lms" in cmd
        def terminate(self): pass
        def communicate(self): return lines, None
    monkeypatch.setattr(subprocess, "Popen", Smi)
    monkeypatch.setattr(host, "launchers", lambda *a: dict(w4a4_pg=None, torch_fp8_gemm=None))
    monkeypatch.setattr(host, "graph_of", lambda fn: (lambda: None))
    assert probes_main(["gpu-clocks", "--out", str(tmp_path / "c.json"), "--seconds", "0"]) == 0
    rows = saved["rows"]
    assert len(rows) == 2 * len(host.CLOCK_SHAPES) and {r["samples"] for r in rows} == {2}
    assert rows[0]["sm_clock_mhz"] == 1675 and rows[0]["reason_share"]["sw_power_cap"] == 0.5
    assert saved["prov"]["command"] == "python -m w4a4_book.probes gpu-clocks --out nbs/data/c.json --seconds 0"


def test_every_probe_has_a_command_line():
    "Each probe parses its own options; `python -m` runs the probes and the checks (here: their help)."
    for name in PROBES:         # each saves a record, but `conversion`, which only prints
        out = [] if name == "conversion" else ["--out", "x.json"]
        assert probe_parser().parse_args([name, *out]).probe == name
    for module in ("w4a4_book.probes", "w4a4_book.checks"):
        r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and f"python -m {module}" in r.stdout, r.stderr


def test_checks_cover_every_registered_sm90_kernel():
    "The sanitizer's cases: a valid config of every registered sm_90a kernel, and each activation format."
    from w4a4_book import smem
    for config, R in checks.gemm_cases().values():
        smem.check_config(config)
    registered = {s.key for s in registry.REGISTRY.values() if s.arch == "sm_90a"}
    assert {registry.spec_for(c).key for c, _ in checks.gemm_cases().values()} == registered
    assert set(checks.ACTIVATION_CASES.values()) == set(act_quant.ACTIVATION_FORMATS)
    assert checks.check_parser().parse_args(["launch", "refused v1 int4 pair 64-row R=256"]).case in checks.refused_cases()


def test_latency_runs_on_stand_ins(monkeypatch, tmp_path, saved):
    "The `latency` probe end to end with the pointer chase stood in for: DRAM and L2, each the median of its runs."
    import w4a4_book.bench.latency as chase
    monkeypatch.setattr(chase, "dram_latency", lambda nbytes, hops: 5e-7)
    assert probes_main(["latency", "--out", str(tmp_path / "l.json"), "--repeats", "3"]) == 0
    assert [(r["where"], r["runs"]) for r in saved["rows"]] == [("dram", [5e-7] * 3), ("l2", [5e-7] * 3)]
    assert saved["prov"]["command"] == "python -m w4a4_book.probes latency --out nbs/data/l.json --repeats 3"


def test_decode_cost_runs_each_variant_in_a_process(monkeypatch, tmp_path, saved):
    "`decode-cost` runs this module once per variant (`--one`), the kernel cache off, and saves every row they print."
    import json
    calls = []

    def run(cmd, env, **k):
        calls.append((cmd, env["W4A4_BOOK_KERNEL_CACHE"]))
        v = cmd[cmd.index("--one") + 1]
        rows = [dict(method=m, variant=v, M=M, N=N, K=K, median_ms=0.1, of_stock=1.0)
                for M, N, K in decode.DECODE_SHAPES for m in ("cute_int8_gemm", v)]
        return subprocess.CompletedProcess(cmd, 0, "ROWS " + json.dumps(rows) + "\n", "")
    monkeypatch.setattr(subprocess, "run", run)
    assert probes_main(["decode-cost", "--out", str(tmp_path / "d.json")]) == 0
    assert [c[c.index("--one") + 1] for c, _ in calls] == list(decode.DECODE_VARIANTS)
    assert all(c[:4] == [sys.executable, "-m", "w4a4_book.probes", "decode-cost"] and off == "off" for c, off in calls)
    assert len(saved["rows"]) == 2 * len(decode.DECODE_SHAPES) * len(decode.DECODE_VARIANTS)
    assert saved["prov"]["command"] == "python -m w4a4_book.probes decode-cost --out nbs/data/d.json"
