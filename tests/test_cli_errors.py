"""Named errors, table by table: every `w4a4-book` command and the public functions of operands, smem, gemm, records,
repro, sweep and bench, given bad values (wrong types, shapes that do not tile, unknown formats and arches, negative
ranks, missing files, unwritable paths, ports in use or out of range), answer with one line that names the argument
first, before any long work starts: on the command line, on stderr with exit code 2 and no traceback (unless
`W4A4_BOOK_TRACEBACK=1`)."""
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from w4a4_book import cli, records, repro, smem, configs, sweep, heuristics, jit, registry, gemm
from w4a4_book.bench import block, layer, report, timing, workloads
from w4a4_book.formats import quantize
from w4a4_book.operands import (Problem, Requirements, check_int32_sum, check_layer_args, check_operands, check_problem,
                                check_quant_inputs, int32_k_limit)

UNWRITABLE = "/proc/w4a4-book-test/x.json"       # /proc takes no new file, even from root
FOLDER_UNWRITABLE = "/proc/w4a4-book-test"


@pytest.fixture
def no_long_work(monkeypatch):
    "Make every long step fail loudly if reached: an argument error must come before it."
    def never(what):
        def f(*a, **k):
            raise AssertionError(f"{what} ran before the argument was refused")
        return f
    monkeypatch.setattr(jit, "compile_on_fakes", never("compile_on_fakes"))
    monkeypatch.setattr(cli, "process_notebooks", never("process_notebooks"))
    monkeypatch.setattr(report, "run_bench", never("run_bench"))
    monkeypatch.setattr(sweep, "sweep_stages", never("sweep_stages"))
    monkeypatch.setattr(repro, "measure_lora_grid", never("measure_lora_grid"))
    monkeypatch.setattr(layer, "run_layer_bench", never("run_layer_bench"))
    monkeypatch.setattr(block, "run_block_bench", never("run_block_bench"))


def run_cli(*argv) -> tuple[int, str, str]:
    "Exit code, stdout and stderr of `w4a4-book argv...`, run in this process."
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _a_file(tmp_path) -> str:
    f = tmp_path / "a-file"
    f.write_text("not a folder")
    return str(f)


# (argv, what the message after "error: " starts with); a callable argv is given tmp_path
CLI_CASES = [
    # render
    (["render", "--dest", FOLDER_UNWRITABLE], "--dest: cannot write in /proc"),
    (lambda t: ["render", "--dest", _a_file(t)], "--dest: "),
    (["render", "--engine", "pandoc"], "argument --engine: invalid choice"),
    (["render", "--workers", "0"], "argument --workers: 0 is not a positive int"),
    (["render", "--workers", "two"], "argument --workers: 'two' is not an int"),
    # serve
    (["serve", "--port", "-1"], "argument --port: -1 is not a port"),
    (["serve", "--port", "99999"], "argument --port: 99999 is not a port"),
    (["serve", "--port", "http"], "argument --port: 'http' is not an int"),
    (lambda t: ["serve", "--dir", str(t)], "dir "),
    # compile
    (["compile", "--ptx", "/nonexistent/dir/x.ptx"], "--ptx: the folder /nonexistent/dir does not exist"),
    (["compile", "--ptx", UNWRITABLE], "--ptx: "),
    (lambda t: ["compile", "--ptx", str(t)], "--ptx: "),
    (lambda t: ["compile", "--ptx", _a_file(t) + "/x.ptx"], "--ptx: "),
    (["compile", "--arch", "sm_80"], "argument --arch: invalid choice"),
    (["compile", "--fmt", "bogus"], "argument --fmt: invalid choice"),
    (["compile", "v9"], "argument KERNEL: invalid choice"),
    (["compile", "v2", "--fmt", "nvfp4"], "fmt: no kernel computes 'nvfp4' on sm_90a"),
    (["compile", "v2sk", "--fmt", "int4"], "kernel: 'v2sk' does not compute 'int4'"),
    (["compile", "v1", "--mainloop", "smem"], "mainloop: 'smem'"),
    (["compile", "--shape", "8", "256", "100", "32"], "K: K=100 must be a multiple"),
    (["compile", "--shape", "8", "256", "256", "-16"], "R: must be a non-negative int"),
    (["compile", "--shape", "8", "256", "256", "24"], "lora_act: rank R=24"),
    (["compile", "--shape", "8", "300", "256", "16"], "wgt: N=300 must be a multiple"),
    (["compile", "--shape", "8", "x", "256", "16"], "argument --shape: invalid int value"),
    (["compile", "--stages", "1"], "stages=1: "),
    (["compile", "--cluster-n", "3"], "cluster_n=3: "),
    (["compile", "--cta-group", "2"], "--cta-group: "),
    (["compile", "--arch", "sm_100a", "--cluster-n", "2"], "--cluster-n: "),
    # bench
    (["bench", "--methods", "nope"], "argument --methods: 'nope' is not a method"),
    (["bench", "--fmt", "int2"], "argument --fmt: invalid choice"),
    (["bench", "--shapes", "m9"], "argument --shapes: invalid choice"),
    (["bench", "--iters", "3"], "iters must be an int >= 20"),
    (["bench", "--warmup", "-1"], "warmup must be a non-negative int"),
    (["bench", "--ranks", "-16"], "ranks must be a non-empty list of positive ints"),
    (["bench", "--tag", "a/b"], "tag must be letters"),
    (["bench", "--out", UNWRITABLE], "--out: "),
    (["bench", "--check", "--baseline", "/nonexistent/record.json"], "--baseline: no record at /nonexistent/"),
    # repro
    (["repro", "lora-bug-2"], "argument experiment: invalid choice"),
    (["repro", "lora-bug", "--ranks", "24"], "--ranks: [24] are not positive multiples of 16"),
    (["repro", "lora-bug", "--ranks", "-16"], "--ranks: [-16] are not positive multiples of 16"),
    (["repro", "lora-bug", "--iters", "2"], "iters must be an int >= 20"),
    (["repro", "lora-bug", "--out", UNWRITABLE], "--out: "),
    (["repro", "lora-bug", "--fmt", "nvfp4"], "argument --fmt: invalid choice"),
    (["repro", "ladder", "--out", UNWRITABLE], "--out: "),
    # sweep-stages
    (["sweep-stages", "--cluster-n", "3"], "cluster_n=3: "),
    (["sweep-stages", "--fmt", "nvfp4"], "argument --fmt: invalid choice"),
    (["sweep-stages", "--versions", "v9"], "argument --versions: invalid choice"),
    (["sweep-stages", "--versions", "v2sk", "--fmt", "int4"], "kernel: 'v2sk' does not compute 'int4'"),
    (["sweep-stages", "--iters", "1"], "iters must be an int >= 20"),
    (["sweep-stages", "--out", UNWRITABLE], "--out: "),
    # bench-layer
    (["bench-layer", "--rank", "-16"], "--rank: must be a positive multiple of 16"),
    (["bench-layer", "--rank", "24"], "--rank: must be a positive multiple of 16"),
    (["bench-layer", "--iters", "0"], "iters must be an int >= 20"),
    (["bench-layer", "--grid"], "--grid: "),
    (["bench-layer", "--shapes", "m9"], "argument --shapes: invalid choice"),
    (["bench-layer", "--out", UNWRITABLE], "--out: "),
    # bench-block
    (["bench-block", "--heads", "5"], "hidden=3072 must be a multiple of heads=5"),
    (["bench-block", "--tokens", "-1"], "tokens must be a positive int"),
    (["bench-block", "--hidden", "x"], "argument --hidden: invalid int value"),
    (["bench-block", "--modes", "warp"], "argument --modes: invalid choice"),
    (["bench-block", "--iters", "3"], "iters must be an int >= 20"),
    (["bench-block", "--out", UNWRITABLE], "--out: "),
    # bench-gemm
    (["bench-gemm"], "the following arguments are required: --variants"),
    (["bench-gemm", "--variants", "nope"], "argument --variants: invalid choice"),
    (["bench-gemm", "--variants", "epilogue", "--iters", "3"], "iters must be an int >= 20"),
    (["bench-gemm", "--variants", "epilogue", "--rank", "24"], "--rank: must be a positive multiple of 16"),
    (["bench-gemm", "--variants", "epilogue", "--out", UNWRITABLE], "--out: "),
    # bench-flux
    (["bench-flux", "--res", "1000"], "resolution must be a positive multiple of 16"),
    (["bench-flux", "--methods", "int8"], "argument --methods: invalid choice"),
    (["bench-flux", "--iters", "3"], "iters must be an int >= 20"),
    (["bench-flux", "--out", UNWRITABLE], "--out: "),
    # no command
    (["no-such-command"], "argument COMMAND: invalid choice"),
]


def _id(case):
    argv = case[0]
    return " ".join(argv) if isinstance(argv, list) else case[1].split(":")[0] + " (a path)"


@pytest.mark.parametrize("argv, starts", CLI_CASES, ids=[_id(c) for c in CLI_CASES])
def test_cli_error_is_one_named_line(argv, starts, tmp_path, no_long_work, monkeypatch):
    monkeypatch.delenv(cli.TRACEBACK_VAR, raising=False)
    argv = argv(tmp_path) if callable(argv) else argv
    code, out, err = run_cli(*argv)
    lines = err.strip().splitlines()
    prog = f"w4a4-book {argv[0]}" if argv[0] in cli.COMMANDS else "w4a4-book"
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith(f"{prog}: error: {starts}"), lines[0]
    assert "Traceback" not in err + out


def test_render_outside_a_checkout_is_named(tmp_path, no_long_work, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("render")
    want = f"w4a4-book render: error: working folder: {tmp_path.resolve()} is not in a checkout of the book"
    assert code == 2 and err.strip().startswith(want)


@pytest.mark.skipif(shutil.which("quarto") is not None, reason="quarto is installed here")
def test_render_with_quarto_missing_is_named(no_long_work):
    code, _, err = run_cli("render", "--engine", "quarto")
    assert code == 2 and err.startswith("w4a4-book render: error: --engine: quarto needs the quarto binary on PATH")


def test_serve_port_in_use_is_named(tmp_path):
    (tmp_path / "index.html").write_text("<title>x</title>")
    with cli.book_server(tmp_path) as taken:
        code, _, err = run_cli("serve", "--dir", str(tmp_path), "--port", str(taken.server_port))
    assert code == 2 and err.strip() == (f"w4a4-book serve: error: port: 127.0.0.1:{taken.server_port} is in use; pick "
                                         f"another, or 0 for a free one (set {cli.TRACEBACK_VAR}=1 for the traceback)")


def test_a_real_process_prints_no_traceback_unless_asked(tmp_path):
    "The console script as a user runs it: one line and exit code 2; with W4A4_BOOK_TRACEBACK=1, the traceback."
    cmd = [sys.executable, "-c", "import sys; from w4a4_book.cli import main; sys.exit(main())", "compile",
           "--ptx", "/nonexistent/dir/x.ptx"]
    env = {k: v for k, v in os.environ.items() if k != cli.TRACEBACK_VAR}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert (r.returncode, r.stderr.count("\n"), "Traceback" in r.stderr) == (2, 1, False), r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, env={**env, cli.TRACEBACK_VAR: "1"}, timeout=120)
    assert r.returncode != 0 and "Traceback" in r.stderr and "--ptx: the folder /nonexistent/dir" in r.stderr


def test_bench_help_fits_a_screen():
    code, out, _ = run_cli("bench", "--help")
    assert code == 0 and len(out) < 2000 and out.count("w4a4_pg_pure_2cta") == 0
    code, out, _ = run_cli("bench", "--list-methods")
    assert code == 0 and all(m in out for m in workloads.ALL_METHODS)


def test_compile_help_names_each_kernel_once():
    "Each registry row is one line of `compile --help`, named by arch, format, kernel and mainloop."
    code, out, _ = run_cli("compile", "--help")
    assert code == 0 and "for sm_90a" not in out
    table = out[out.index("--arch   --fmt"):]
    rows = [l.split()[:4] for l in table.splitlines()[1:] if re.match(r"  sm_\d+a ", l)]
    keys = [(a, k.rstrip("*"), f, m) for a, f, k, m in rows]     # REGISTRY's keys: (arch, kernel, fmt, mainloop)
    assert sorted(keys) == sorted(registry.REGISTRY) and len(set(keys)) == len(keys)


def test_one_default_format():
    "The library and every command that takes a format default to int4_pg, the layer's."
    from w4a4_book import layers
    assert registry.DEFAULT_FMT == layers.DEFAULT_FMT == "int4_pg"
    assert registry.find_kernel().fmt == registry.default_config().fmt == registry.DEFAULT_FMT
    for command in ("compile", "bench", "sweep-stages"):
        args = cli.parser(command).parse_args([command])
        fmt = registry.default_fmt(args.arch) if command == "compile" and args.fmt is None else args.fmt
        assert fmt == "int4_pg", command


# ---------------------------------------------------------------- the public functions
GOOD_PROV = dict(gpu="none", driver="none", torch="x", cutlass_dsl="x", commit="x", date="x", shapes=[[1, 2, 3, 4]],
                 command="x")
PG = dict(scale_dtype=torch.uint8, fmt="int4_pg")

API_CASES = [
    # operands
    (lambda: Problem(8, 256, 100, 32), ValueError, "K: K=100 must be a multiple of the int4 group size 64"),
    (lambda: Problem(8, 256, 100, 32, **PG), ValueError, "K: K=100 must be a multiple of the int4_pg group size 64"),
    (lambda: Problem(8, 256, 256, 32, fmt="bogus"), ValueError, "fmt: 'bogus' is not a weight format"),
    (lambda: Problem(8, 256, 256, 32, act_fmt="nvfp4"), ValueError, "act_fmt: 'nvfp4' does not pair"),
    (lambda: Problem(8, 256, 256, -16), ValueError, "R: must be a non-negative int"),
    (lambda: Problem("8", 256, 256, 16), ValueError, "M: must be a positive int"),
    (lambda: Problem(8, 256, 256, 16, out_dtype="bf16"), TypeError, "out_dtype: must be a torch.dtype"),
    (lambda: Problem(8, 256, 256, 16, has_bias=1), TypeError, "has_bias: must be a bool"),
    (lambda: Problem(8, 256, 2 ** 20, 16, scale_dtype=torch.uint8, fmt="int4_pg", act_fmt="int8"), ValueError, "K="),
    (lambda: check_operands("a", "b"), TypeError, "act must be a QTensor"),
    (lambda: check_problem(Requirements("x"), (8, 256, 256, 16)), TypeError, "problem: expected a Problem"),
    (lambda: int32_k_limit("bogus", "int4"), ValueError, "act_fmt='bogus' is not a known format"),
    (lambda: check_int32_sum(1.5, "int8", "int4_pg"), TypeError, "K must be an int"),
    (lambda: check_quant_inputs([1], group_size=64, max_rank=256), TypeError, "x: expected a torch.Tensor"),
    (lambda: check_layer_args(100, 64, 16, "int4", torch.bfloat16, group_size=64, rank_multiple=16,
                              dtypes=(torch.bfloat16,), backend="sm90", backends=("sm90",)),
     ValueError, "in_features: "),
    # smem
    (lambda: smem.ProblemSpec(R=-1), ValueError, "R=-1: must be an int >= 0"),
    (lambda: smem.solve(configs.HopperV2Config(), smem.ProblemSpec(R=24)), ValueError, "R=24: must be >= 0, a multiple"),
    (lambda: smem.solve(configs.HopperV2Config(), None), TypeError, "problem: a hopper_v2 config holds tuning alone"),
    (lambda: configs.HopperV1Config(tile_m="128"), TypeError, "tile_m must be an int"),
    (lambda: configs.HopperPgConfig(arch="sm_80"), ValueError, "arch='sm_80'"),
    (lambda: configs.HopperPgConfig(fmt="int4"), ValueError, "fmt='int4'"),
    (lambda: configs.Sm100V2Config(acc_stages=3), ValueError, "acc_stages=3"),
    (lambda: smem.solve("cfg", smem.ProblemSpec()), TypeError, "cfg must be a config whose class carries its budget rules"),
    (lambda: smem.solve(configs.HopperV1Config(), smem.ProblemSpec(K=-1)), ValueError, "K=-1: must be an int >= 1"),
    (lambda: configs.explain("nope"), ValueError, "cfg='nope'"),
    (lambda: smem.Term("x", 3, 3, "int8", None, ""), ValueError, "align=3"),
    # gemm
    (lambda: registry.find_kernel(fmt="bogus"), ValueError, "fmt: no kernel computes 'bogus'"),
    (lambda: registry.find_kernel("v9"), ValueError, "kernel: 'v9'"),
    (lambda: registry.find_kernel(arch="sm_80"), ValueError, "arch: 'sm_80': no kernel compiles for it"),
    (lambda: registry.find_kernel(fmt=4), TypeError, "fmt: must be a str"),
    (lambda: registry.default_config("bogus"), ValueError, "fmt: no kernel computes 'bogus'"),
    (lambda: registry.default_config(fmt=["int4"]), TypeError, "fmt: must be a str"),
    (lambda: registry.default_config(problem=(1, 2, 3, 4)), TypeError, "problem: expected an operands.Problem"),
    (lambda: jit.compile_kernel(arch="sm_80"), ValueError, "arch: 'sm_80': v2 (int4_pg, rs, sm_90a) compiles for"),
    (lambda: jit.compile_kernel("cfg"), TypeError, "config: expected one of"),
    (lambda: jit.compile_kernel(problem="p"), TypeError, "problem: expected an operands.Problem"),
    (lambda: jit.compile_kernel(configs.HopperV1Config(), Problem(4352, 3072, 3008, 32)), ValueError,
     "act: K=3008 must be a multiple of 128"),
    (lambda: jit.compile_kernel(configs.HopperPgConfig(), Problem(4352, 3072, 3840, 32)), ValueError,
     "act: format 'int4'"),
    (lambda: registry.spec_for(5), TypeError, "config: expected one of"),
    (lambda: jit.example_problem(registry.find_kernel(), K=100), ValueError, "K: K=100"),
    (lambda: smem.solve(configs.HopperV2Config(), "p"), TypeError, "problem: must be a ProblemSpec or an operands.Problem"),
    (lambda: smem.solve(configs.HopperPgConfig(), Problem(8, 256, 256, 32)), ValueError, "scale_dtype='float16'"),
    (lambda: heuristics.tile_choice(configs.HopperPgConfig(), "p"), TypeError, "problem: expected an operands.Problem"),
    (lambda: heuristics.k_splits(4, 60, 132, ctas_per_sm=0), ValueError, "ctas_per_sm: must be an int >= 1"),
    (lambda: gemm.gemm_w4a4(quantize(torch.randn(8, 128), "int4"), quantize(torch.randn(128, 128), "int4")), ValueError,
     "act: must be on a CUDA device"),
    # records
    (lambda: records.validate("x"), TypeError, "provenance must be a dict"),
    (lambda: records.provenance("", [[1]]), ValueError, "command must be"),
    (lambda: records.save_record("x.txt", GOOD_PROV, [{"a": 1}]), ValueError, "path must end in"),
    (lambda: records.save_record(UNWRITABLE, GOOD_PROV, [{"a": 1}]), ValueError, "path: "),
    (lambda: records.save_record("x.json", GOOD_PROV, []), ValueError, "rows must be"),
    (lambda: records.load_record("/nonexistent/x.json"), FileNotFoundError, "path: no record at /nonexistent/x.json"),
    (lambda: records.list_records(5), ValueError, "kind must be"),
    (lambda: records.markdown_table("x"), TypeError, "rows must be"),
    (lambda: records.check_output_path(UNWRITABLE, "--out"), ValueError, "--out: "),
    (lambda: records.check_output_path(5), TypeError, "path: must be a non-empty path"),
    (lambda: records.remeasure("x"), TypeError, "provenance: "),
    # repro
    (lambda: repro.accounting_rows(ranks=(-16,)), ValueError, "ranks: [-16] are not positive multiples of 16"),
    (lambda: repro.accounting_rows(ranks=32), ValueError, "ranks: must be a non-empty list"),
    (lambda: repro.find_moves(ranks=[24]), ValueError, "ranks: [24]"),
    (lambda: repro.find_moves(k=-1), ValueError, "k: must be a positive int"),
    (lambda: repro.original_history(R=-16), ValueError, "R: -16 is not a positive multiple of 16"),
    (lambda: repro.model_budget(R=24), ValueError, "R: 24 is not a positive multiple of 16"),
    (lambda: repro.measure_ladder(fmt="nvfp4"), ValueError, "fmt='nvfp4'"),
    (lambda: repro.row_config(dict(kernel="v9", fmt="int4", cluster_n=2, tile_m=128, accounting="per_cta")), ValueError,
     "kernel: 'v9'"),
    # sweep
    (lambda: sweep.max_stages(configs.HopperV2Config(), "p"), TypeError, "problem: expected an operands.Problem"),
    (lambda: sweep.curves([{"version": "v2"}]), ValueError, "rows: rows[0] lacks M"),
    (lambda: sweep.sweep_table([]), ValueError, "rows: must be a non-empty list"),
    (lambda: sweep.curve_config(("v9", 1, 1, 1, 1, 1, "int4", None)), ValueError, "kernel: 'v9'"),
    (lambda: sweep.min_stages("cfg"), TypeError, "config: expected a smem family's config"),
    # bench
    (lambda: workloads.bench_problems("m9"), ValueError, "which must be one of"),
    (lambda: workloads.bench_problems(ranks=[-1]), ValueError, "ranks must be"),
    (lambda: workloads.make_workload(8, 256, 100, 32, device="cpu"), ValueError, "K=100 is not a multiple"),
    (lambda: workloads.make_workload(8, 256, 256, 24, device="cpu"), ValueError, "R=24 is not a multiple"),
    (lambda: workloads.make_workload(8, 256, 256, 32, fmt="bogus", device="cpu"), ValueError, "fmt"),
    (lambda: workloads.default_methods("bogus"), ValueError, "fmt"),
    (lambda: report.bench_path("NVIDIA H200", "a/b"), ValueError, "tag must be"),
    (lambda: report.mfu_floors([], fraction=2), ValueError, "fraction must be"),
    (lambda: report.geomean([]), ValueError, "values must be"),
    (lambda: report.bench_table([], "speed"), ValueError, "value must be"),
    (lambda: report.speedups([{"method": "a"}], "b", "a"), ValueError, "method='b' has no row"),
    (lambda: layer.layer_shapes("m9"), ValueError, "which must be"),
    (lambda: block.check_block_shape(0, 3072, 12288, 24), ValueError, "tokens must be a positive int"),
    (lambda: timing.check_timing(3, 0), ValueError, "iters must be an int >= 20"),
]


@pytest.mark.parametrize("call, kind, starts", API_CASES, ids=[c[2].split(":")[0][:40] for c in API_CASES])
def test_api_error_names_the_argument(call, kind, starts):
    with pytest.raises(kind) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(starts), msg


def test_render_names_a_failing_cell(monkeypatch):
    "A cell that fails while the book is built: exit code 1 and its notebook, place, code and error on stderr."
    def fail(**kwargs):
        raise cli.CellError("nbs/99_demo.ipynb: cell 3 (id c3) failed while building the book:\n1 / 0\nZeroDivisionError")
    monkeypatch.setattr(cli, "render_book", fail)
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    code, out, err = run_cli("render", "--dest", "_docs")
    assert code == 1 and out == ""
    assert err.startswith("w4a4-book render: error: nbs/99_demo.ipynb: cell 3 (id c3) failed while building the book")
