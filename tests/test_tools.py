"tools/ncu_stalls.py: the parser of ncu's CSV pages, the kernel it names, and the roles and grid it attributes samples to (the profiling itself needs a GPU and ncu)."
import importlib.util
import shlex
from pathlib import Path

import pytest

from w4a4_book import act_quant, gemm, heuristics, jit, registry
from w4a4_book.operands import Problem
from w4a4_book.records import data_dir, list_records, load_record
from w4a4_book.smem import HopperV1Config, HopperV2Config

spec = importlib.util.spec_from_file_location("ncu_stalls", Path(__file__).resolve().parent.parent / "tools" / "ncu_stalls.py")
ncu_stalls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_stalls)

CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","127.0.0.1","kernel_cutlass_kernel_w4a4_x","1","7","(512, 1, 1)","(132, 1, 1)","0","9.0","SchedulerStats","Issue Slots Busy","%","61.20"
"0","1","python3","127.0.0.1","kernel_cutlass_kernel_w4a4_x","1","7","(512, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","","1,234.5"
"0","1","python3","127.0.0.1","kernel_cutlass_kernel_w4a4_x","1","7","(512, 1, 1)","(132, 1, 1)","0","9.0","SpeedOfLight","Memory Throughput","","n/a"
'''


def test_parse_details_csv():
    metrics, kernel = ncu_stalls.parse(CSV)
    assert kernel == "kernel_cutlass_kernel_w4a4_x"
    assert metrics["SchedulerStats"] == {"Issue Slots Busy (%)": 61.2}
    assert metrics["Command line profiler metrics"]["smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"] == 1234.5
    assert metrics["SpeedOfLight"]["Memory Throughput"] == "n/a"


def test_parse_details_of_two_launches():
    "The activation side's two passes: each launch's metrics apart, in launch order, named by its kernel."
    second = CSV.splitlines()[2].replace('"0","1"', '"1","1"', 1).replace("w4a4_x", "w4a4_y").replace("61.20", "12.50")
    launches = ncu_stalls.parse_kernels(CSV + second + "\n")
    assert [k for k, _ in launches] == ["kernel_cutlass_kernel_w4a4_x", "kernel_cutlass_kernel_w4a4_y"]
    assert launches[1][1] == {"SchedulerStats": {"Issue Slots Busy (%)": 12.5}}
    assert ncu_stalls.parse(CSV)[0] == launches[0][1]


def test_activation_profile_command():
    "`--activation` profiles every kernel of the last call (two for int4_pg's passes), and `--one-pass` only with it."
    a = ncu_stalls.parser().parse_args(["--activation", "--fmt", "int4_pg", "--shape", "4352", "0", "3840", "32", "--out", "x.json"])
    a.kernel = "activation"
    assert [ncu_stalls.activation_launches(f, c) for f, c in (("int4_pg", None), ("int8", None), ("int4", None), ("int4_pg", 16))] == [2, 2, 1, 1]
    cmd = ncu_stalls.ncu_command(a, launches=ncu_stalls.activation_launches(a.fmt, a.one_pass))
    assert cmd[cmd.index("--launch-skip") + 1] == str(2 * ncu_stalls.WARMUP) and cmd[cmd.index("--launch-count") + 1] == "2"
    assert "--activation" in cmd and "--one-pass" not in cmd
    with pytest.raises(SystemExit, match="--one-pass: only with --activation"):
        ncu_stalls.main(["--one-pass", "4", "--out", "x.json"])


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
    ins = ncu_stalls.parse_source(SOURCE)
    assert [i["Address"] for i in ins] == ["0x10", "0x20", "0x30", "0x40", "0x50", "0x60", "0x70"]
    assert ins[-1]["Instructions Executed"] == 1600.0
    roles = ncu_stalls.by_role(ins, k_blocks_per_cta=10, ctas=2, roles_by_regs={24: ("load", 4), 224: ("mma", 8)})
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
    assert ncu_stalls.kernel_roles(v2) == {r.load_regs: ("load", 4), r.decode_regs: ("decode", 4), r.mma_regs: ("mma", 8)}
    assert ncu_stalls.kernel_roles(v1) == {None: ("all", 8)}


def test_kernel_is_a_registry_name():
    "`--kernel` names a registry row, run with its config at every default; no name is the default kernel."
    assert ncu_stalls.kernel_config("v1")[1] == HopperV1Config()
    assert ncu_stalls.kernel_config("v2")[1] == HopperV2Config()
    spec, config = ncu_stalls.kernel_config(None)
    assert spec.kernel == registry.find_kernel(fmt="int4").kernel and config == registry.default_config("int4")   # the tool's int4
    with pytest.raises(ValueError, match="kernel"):
        ncu_stalls.kernel_config("v3")


def test_int4_pg_kernel_and_roles():
    "`--fmt int4_pg` names the exact-integer kernel with the tile the library picks for the shape; it has no decode role."
    spec, config = ncu_stalls.kernel_config(None, "int4_pg", (4352, 3072, 10240, 128))
    assert spec.fmt == "int4_pg" and config == registry.default_config("int4_pg", problem=jit.example_problem(spec, 4352, 3072, 10240, 128))
    kern, _ = jit.build(config, jit.example_problem(spec, 4352, 3072, 10240, 128))
    r = kern.roles
    assert ncu_stalls.kernel_roles(kern) == {r.load_regs: ("load", r.first_worker_warp), r.mma_regs: ("mma", len(r.mma_warps))}
    a = ncu_stalls.parser().parse_args(["--fmt", "int4_pg", "--out", "x.json"])
    assert ncu_stalls._fmt_arg(a) == ["--fmt", "int4_pg"] and ncu_stalls._fmt_arg(ncu_stalls.parser().parse_args(["--out", "x"])) == []


@pytest.mark.parametrize("path", list_records("ncu"), ids=lambda p: p.name)
def test_recorded_commands_still_parse(path):
    """Every ncu record's command, written with `--version` before the registry, parses to the kernel its `version` field
    names; an activation profile's, to the format and one-pass cluster its record names."""
    prov, _ = load_record(path)
    args = ncu_stalls.parser().parse_args(shlex.split(prov["command"])[2:])
    if prov["kind"] == "ncu-activation":
        assert args.activation and (args.fmt, args.one_pass) == (prov["fmt"], prov["one_pass"])
        return
    assert ncu_stalls.kernel_config(args.kernel, args.fmt, sets=args.sets)[0].kernel == prov["version"]
    assert args.roles == (prov["kind"] == "ncu-roles")


def test_grid_matches_the_recorded_roles():
    "The CTAs and K-blocks per CTA the role attribution divides by are those of the recorded profiles (H200: 132 SMs)."
    for v in ("v1", "v2"):
        prov, _ = load_record(data_dir() / f"ncu_roles_h200_{v}.json")
        M, N, K, R = prov["shapes"][0]
        kern, _ = jit.build(ncu_stalls.kernel_config(prov["version"])[1], Problem(M, N, K, R), heuristics.DEFAULT_NUM_SMS)
        ctas = ncu_stalls.launched_ctas(kern, M, N)
        assert ctas == prov["ctas"], v
        assert -(-M // kern.bm) * (N // kern.bn) * (K // kern.bk) / ctas == prov["k_blocks_per_cta"], v


def test_config_fields_set_after_the_choice():
    "`--set NAME=VALUE` overrides a field after the library's tile choice, travels to the child, and a bad one is refused by name."
    _, cfg = ncu_stalls.kernel_config("v2", "int4_pg", [4352, 3072, 3840, 32], ["tile_m=256", "epi_vectors=smem", "stages=3"])
    assert (cfg.tile_m, cfg.epi_vectors, cfg.stages) == (256, "smem", 3)
    a = ncu_stalls.parser().parse_args(["--kernel", "v2", "--fmt", "int4_pg", "--set", "tile_m=256", "--out", "x.json"])
    cmd = ncu_stalls.ncu_command(a)
    assert cmd[cmd.index("--set") + 1] == "tile_m=256"
    for bad in ("tile=256", "tile_m=x", "tile_m"):
        with pytest.raises(SystemExit, match="--set"):
            ncu_stalls.kernel_config("v2", "int4_pg", None, [bad])


@pytest.mark.parametrize("tool", ["stream_k_gemm", "epilogue_gemm", "tile_heights", "deferred_store"])
def test_gemm_timing_tools_run_on_stand_ins(tool, monkeypatch, tmp_path):
    "The GEMM-alone tools, end to end, with the GPU's parts (workload, launch, timer, provenance) stood in for: every row saved."
    import sys, torch
    import w4a4_book.bench.timing as timing, w4a4_book.bench.workloads as workloads, w4a4_book.records as recs
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    stand_in = type("W", (), {"operands": (), "out_dtype": torch.bfloat16})
    monkeypatch.setattr(workloads, "make_workload", lambda *a, **k: stand_in())
    monkeypatch.setattr(gemm, "gemm_launcher", lambda *a, **k: ((lambda: None), torch.zeros(2, 2)))
    monkeypatch.setattr(timing, "time_cuda", lambda f, **k: dict(median_ms=0.1, p10_ms=0.1, p90_ms=0.1, n=k["iters"]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(recs, "provenance", lambda command, *a, **k: dict(command=command))
    saved = {}
    monkeypatch.setattr(recs, "save_record", lambda path, prov, rows: saved.update(prov=prov, rows=rows) or path)
    module = importlib.import_module(tool)
    module.main(["--out", str(tmp_path / "r.json"), "--iters", "3"])
    want = sum(len(module.configs(*s, 32)) for s in module.SHAPES)
    assert len(saved["rows"]) == want and saved["prov"]["command"].startswith(f"python tools/{tool}.py --out nbs/data/r.json")


def test_gpu_clocks_runs_on_stand_ins(monkeypatch, tmp_path):
    "tools/gpu_clocks.py end to end with `nvidia-smi` and the GEMMs stood in for: a row per GEMM and shape, idle samples left out."
    import subprocess
    import w4a4_book.records as recs
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    gpu_clocks = importlib.import_module("gpu_clocks")
    lines = "1650, 1980, 690.5, 700.00, 60, 0x0000000000000004\n1700, 1980, 650.0, 700.00, 61, 0x0000000000000000\n345, 1980, 80.0, 700.00, 50, 0x0000000000000001\n"

    class Smi:
        def __init__(self, cmd, **k): assert cmd[0] == "nvidia-smi" and "-lms" in cmd
        def terminate(self): pass
        def communicate(self): return lines, None
    monkeypatch.setattr(subprocess, "Popen", Smi)
    monkeypatch.setattr(gpu_clocks, "launchers", lambda *a: dict(w4a4_pg=None, torch_fp8_gemm=None))
    monkeypatch.setattr(gpu_clocks, "graph_of", lambda fn: (lambda: None))
    monkeypatch.setattr(recs, "provenance", lambda command, *a, **k: dict(command=command))
    saved = {}
    monkeypatch.setattr(recs, "save_record", lambda path, prov, rows: saved.update(prov=prov, rows=rows) or path)
    gpu_clocks.main(["--out", str(tmp_path / "c.json"), "--seconds", "0"])
    rows = saved["rows"]
    assert len(rows) == 2 * len(gpu_clocks.SHAPES) and {r["samples"] for r in rows} == {2}
    assert rows[0]["sm_clock_mhz"] == 1675 and rows[0]["reason_share"]["sw_power_cap"] == 0.5
    assert saved["prov"]["command"] == "python tools/gpu_clocks.py --out nbs/data/c.json --seconds 0"


gpu_checks_spec = importlib.util.spec_from_file_location("gpu_checks", Path(__file__).resolve().parent.parent / "tools"
                                                         / "gpu_checks.py")
gpu_checks = importlib.util.module_from_spec(gpu_checks_spec)
gpu_checks_spec.loader.exec_module(gpu_checks)


def test_gpu_checks_cover_every_registered_sm90_kernel():
    "The sanitizer's cases: a valid config of every registered sm_90a kernel, and each activation format."
    from w4a4_book import smem
    cases = gpu_checks.gemm_cases()
    for config, R in cases.values():
        smem.check_config(config)
    registered = {s.key for s in registry.REGISTRY.values() if s.arch == "sm_90a"}
    assert {registry.spec_for(c).key for c, _ in cases.values()} == registered
    assert set(gpu_checks.ACTIVATION_CASES.values()) == set(act_quant.ACTIVATION_FORMATS)


def test_gpu_checks_parse_sanitizer_and_junit(tmp_path):
    text = ("========= COMPUTE-SANITIZER\n========= Error: Race reported between Write access at f+0x10\n"
            "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n========= ERROR SUMMARY: 1 error\n")
    assert gpu_checks.parse_sanitizer(text) == dict(errors=1, hazards=3, hazard_errors=1, hazard_warnings=2)
    assert gpu_checks.parse_sanitizer("========= ERROR SUMMARY: 0 errors\n") == dict(errors=0)
    assert gpu_checks.parse_sanitizer("Traceback (most recent call last)") == dict(errors=None)
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.test_a" name="test_x"><failure/></testcase>'
                   '<testcase classname="tests.test_a" name="test_y"/></testsuite></testsuites>')
    assert gpu_checks.parse_junit(xml) == dict(tests=4, failures=1, errors=0, skipped=1, passed=2,
                                               failed=["tests/test_a.py::test_x"])
