"""The LoRA accounting experiment and the stage sweep (chapters 7 and 8): solver accounting, the recorded H200
data, the plots and the no-GPU command paths on the CPU; both accounting modes against the reference on a GPU."""
import math
import matplotlib
matplotlib.use("Agg")
import pytest
import torch
from matplotlib.figure import Figure
from dataclasses import replace

from w4a4_book import records, repro, smem, configs, sweep, heuristics, jit, registry, gemm
from w4a4_book.bench import timing, workloads
from w4a4_book.cli import main, parser
from w4a4_book.operands import Problem


def _records(kind):
    paths = records.list_records(kind)
    assert paths, f"no {kind} record under {records.data_dir()}"
    return [(p, *records.load_record(p)) for p in paths]


# ---------------------------------------------------------------- solver accounting
def test_accounting_rows_fix_never_has_fewer_stages():
    rows = repro.accounting_rows()
    by = {(r["config"], r["accounting"]): r for r in rows}
    labels = {r["config"] for r in rows}
    # Hopper int4 v2 and the int4_pg kernel at two tiles, at each rank, both modes
    assert len(labels) == len(repro.LORA_BUG_CONFIGS) * len(repro.LORA_BUG_RANKS) and len(rows) == 2 * len(labels)
    for c in labels:
        bug, fix = by[c, repro.BUG], by[c, repro.FIX]
        if fix["main_stages"] == 0:                  # R=256: not one stage fits even under the fix
            assert bug["main_stages"] == 0 and "note" in fix, c
            continue
        if bug["main_stages"] == 0:                  # the bug alone leaves no stage
            assert "note" in bug and fix["phantom"] == 0, c
            continue
        assert fix["main_stages"] >= bug["main_stages"] >= 1, c
        assert fix["phantom"] == 0 and fix["charged"] == fix["allocated"], c
        assert bug["phantom"] == bug["charged"] - bug["allocated"] > 0, c


def test_accounting_rows_known_hopper_stages():
    st = {(r["config"], r["accounting"]): r["main_stages"] for r in repro.accounting_rows()}
    assert (st["v2 int4 2-CTA 128x128 R=128", "per_cta"], st["v2 int4 2-CTA 128x128 R=128", "pair"]) == (3, 1)
    assert (st["v2 int4 2-CTA 128x128 R=32", "per_cta"], st["v2 int4 2-CTA 128x128 R=32", "pair"]) == (6, 6)


def test_accounting_rows_single_cta_has_no_bug():
    rows = repro.accounting_rows(cluster_n=1)
    assert rows and all(r["phantom"] == 0 for r in rows if r["main_stages"])
    assert all(r["main_stages"] or "note" in r for r in rows)


@pytest.mark.parametrize("kw, match", [(dict(ranks=(24,)), r"ranks: \[24\]"), (dict(ranks=32), "ranks"),
                                       (dict(ranks=()), "ranks"), (dict(cluster_n=3), "cluster_n=3")])
def test_accounting_rows_rejects_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        repro.accounting_rows(**kw)


def test_bug_and_fix_are_the_solver_modes():
    assert {repro.BUG, repro.FIX} == set(configs.HopperV2Config.rules.accountings) < set(smem.LORA_ACCOUNTING)
    assert repro.LORA_BUG_PROBLEMS == tuple(workloads.bench_problems("m4352", ranks=repro.LORA_BUG_RANKS))
    assert repro.LORA_BUG_CONFIG == configs.HopperV2Config(cluster_n=2)     # v2 as a pair: the only kernel with a pair to mis-charge


# ---------------------------------------------------------------- the original's two fixes, and the model's prediction
def test_original_history_is_the_two_fixes():
    "First formula (LA and LU at the pair's width), the first fix (LA per CTA), the second (LU per CTA): 4, none, 2, 4."
    h = repro.original_history()
    assert [(r["accounting"], r["lora_stages"], r["main_stages"]) for r in h] == [
        ("pair", 1, 4), ("pair", 2, 0), ("pair_lu", 2, 2), ("per_cta", 2, 4)]
    assert [r["commit"] for r in h][2:] == ["c1d209c", "7296e90"]
    assert (h[2]["LA"], h[2]["LU"], h[3]["LU"]) == (32768, 32768, 16384)


def test_the_model_predicts_the_published_budget():
    "Every quoted term and stage count of the original's re-solved budget equals the solver's, and the bug's 4 -> 2."
    table = repro.prediction_table()
    assert all(r["agree"] == "yes" for r in table), [r for r in table if r["agree"] != "yes"]
    pub = repro.published_budget()
    assert pub["terms"] == dict(capacity=232448, LA=32768, LU=16384, main_stage=28672, epi_stage=8192)
    assert pub["fit"] == {0: (3, 7), 1: (4, 5), 2: (2, 4), 3: (3, 2), 4: None}
    assert repro.model_budget() == pub
    lu = smem.solve(replace(repro.ORIGINAL, lora_stages=2, lora_accounting="pair_lu"), smem.ProblemSpec(R=128))
    assert lu.stages["main"] == 2 and lu.total - lu.allocated == 2 * 16384     # LU's phantom half, two LoRA stages


def test_verdict_names_both_cards_and_the_same_card_factor():
    v = repro.verdict()
    assert "B300" in v and "B200" in v and "1.45x" in v and "+198%" in v and "c1d209c" in v and "7296e90" in v


# ---------------------------------------------------------------- the same move on Hopper
def test_find_moves_finds_the_original_move():
    moves = repro.find_moves()
    assert all(r["stages_per_cta"] >= repro.MOVE_DEEP and r["stages_pair"] <= repro.MOVE_SHALLOW for r in moves)
    exact = {(r["config"], r["R"]) for r in moves if (r["stages_pair"], r["stages_per_cta"]) == (2, 4) and r["bug_builds"]}
    assert exact == {("v2 int4_pg 2-CTA 128x128 L=3", 64), ("v2 int4_pg 2-CTA 128x128 L=3 chunk 64", 128),
                     ("v2 int4_pg 2-CTA 128x128 L=3 chunk 64", 256), ("v1 int4_pg 2-CTA 128x128 L=3", 64)}
    assert not any(r["config"].startswith("v2 int4 ") and r["bug_builds"] for r in moves)
    assert len({(r["config"], r["R"]) for r in moves}) == len(moves)             # each config once


@pytest.mark.parametrize("config, R", [(c, R) for c, ranks in repro.LORA_MOVES for R in ranks])
def test_move_configs_compile_with_the_solvers_storage(config, R):
    "Each measured move compiles for sm_90a on the CPU, under both accountings, with the solver's struct and stages."
    from test_kernels_pg import check_compiled
    spec = registry.spec_for(config)
    p = jit.example_problem(spec, 4352, 3072, 3840, R)
    got = {}
    for acct in (repro.BUG, repro.FIX):
        rep = jit.compile_kernel(replace(config, lora_accounting=acct), p)
        assert rep.smem_bytes == rep.budget.allocated
        got[acct] = rep.budget.stages["main"]
        if spec.fmt == "int4_pg":
            check_compiled(rep, R, a_in_registers=True)
    assert got[repro.BUG] <= repro.MOVE_SHALLOW and got[repro.FIX] >= repro.MOVE_DEEP


def test_measure_moves_rows_with_a_fake_gpu(fake_gpu):
    "A move's rows: the two builds, then every forced depth between, each rebuilt from its row by `row_config`."
    from w4a4_book.reference import w4a4_gemm_ref
    seen = []

    def fake_launcher(*ops, out_dtype, config):
        seen.append(config)
        out = torch.empty(ops[0].rows, ops[1].rows, dtype=out_dtype)
        def launch(): out.copy_(w4a4_gemm_ref(*ops))
        launch.ms = 4.0 / (config.stages or {repro.BUG: 2, repro.FIX: 4}[config.lora_accounting])
        return launch, out

    fake_gpu(fake_launcher)
    rows = repro.measure_lora_bug([(128, 256, 1024, 128)], config=repro.LORA_MOVE_CONFIG, sweep=True, iters=5, quiet=True)
    assert [(r["accounting"], r["main_stages"], r.get("forced", False)) for r in rows] == [
        (repro.BUG, 2, False), (repro.FIX, 4, False), (repro.FIX, 3, True)]
    assert all(repro.row_config(r) == replace(repro.LORA_MOVE_CONFIG, lora_accounting=r["accounting"]) for r in rows)
    assert [s["fixed_over_bug"] for s in repro.lora_bug_summary(rows)] == [2.0]
    table = repro.move_table(rows)
    assert "(bug)" in table and "(fix)" in table and "2.00x" in table
    assert isinstance(repro.plot_moves(rows), Figure)


# ---------------------------------------------------------------- recorded LoRA accounting data
def test_recorded_lora_bug_is_consistent():
    for path, prov, rows in _records("lora_bug"):
        assert records.validate(prov) and prov["command"].startswith("w4a4-book repro lora-bug"), path.name
        problems = {(r["M"], r["N"], r["K"], r["R"]) for r in rows}
        assert problems == {tuple(s) for s in prov["shapes"]}, path.name
        peak = timing.peak_for(prov["gpu"])
        for r in rows:
            # the stage count the record names is the one the solver gives for that problem, kernel and mode (0: none fits)
            cfg = repro.row_config(r)
            p = jit.example_problem(registry.spec_for(cfg), r["M"], r["N"], r["K"], r["R"])
            solved = repro._main_stages(cfg, p)[0]
            if r.get("forced"):                      # a depth-sweep point: a stage count the solver's choice allows
                assert 1 <= r["main_stages"] <= solved and "fixed_over_bug" not in r, (path.name, r)
            else:
                assert solved == r["main_stages"], (path.name, r)
            if r["tflops"] is None:                  # the bug left no stage: nothing was built or timed
                assert r["main_stages"] == 0 and r["accounting"] == repro.BUG and "note" in r
                continue
            assert math.isclose(r["tflops"], timing.tflops(r["M"], r["N"], r["K"], r["median_ms"]), rel_tol=1e-9)
            assert math.isclose(r["mfu"], r["tflops"] / peak, rel_tol=1e-9)
            assert r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        for s in repro.lora_bug_summary(rows):
            assert s["stages_per_cta"] >= s["stages_pair"]
            mine = [r for r in rows if not r.get("forced")
                    and (r.get("config") or s["config"], r["M"], r["N"], r["K"], r["R"]) == (s["config"], s["M"], s["N"], s["K"], s["R"])]
            want = None if s["tflops_pair"] is None else s["tflops_per_cta"] / s["tflops_pair"]
            assert all(r["fixed_over_bug"] == want or math.isclose(r["fixed_over_bug"], want, rel_tol=1e-9) for r in mine)


def test_recorded_lora_bug_identical_builds_time_alike():
    "Where both modes pick the same stages the builds are the same kernel: their timing spreads overlap."
    for path, _, rows in _records("lora_bug"):
        label = lambda r: r.get("config") or repro.config_label(repro.LORA_BUG_CONFIG)
        by = {(label(r), r["M"], r["N"], r["K"], r["R"], r["accounting"]): r for r in rows}
        for s in repro.lora_bug_summary(rows):
            if s["stages_pair"] != s["stages_per_cta"]: continue
            a, b = (by[s["config"], s["M"], s["N"], s["K"], s["R"], m] for m in (repro.BUG, repro.FIX))
            assert a["p10_ms"] <= b["p90_ms"] and b["p10_ms"] <= a["p90_ms"], (path.name, s)


def test_lora_bug_summary_needs_both_modes():
    _, _, rows = _records("lora_bug")[0]
    with pytest.raises(ValueError, match="both modes"):
        repro.lora_bug_summary([r for r in rows if r["accounting"] == repro.FIX])
    with pytest.raises(ValueError, match="accounting"):
        repro.lora_bug_summary([{**rows[0], "accounting": "cluster"}])


def test_plot_lora_bug(tmp_path):
    _, _, rows = _records("lora_bug")[0]
    fig = repro.plot_lora_bug(rows, tmp_path / "bug.png")
    assert isinstance(fig, Figure) and (tmp_path / "bug.png").stat().st_size > 0
    assert "|" in repro.lora_bug_table(rows) and "x |" in repro.lora_bug_table(rows)


# ---------------------------------------------------------------- recorded stage sweeps
def test_recorded_sweeps_are_consistent():
    for path, prov, rows in _records("sweep_stages"):
        assert records.validate(prov) and prov["command"].startswith("w4a4-book sweep-stages"), path.name
        peak = timing.peak_for(prov["gpu"])
        for key, c in sweep.curves(rows).items():
            v, M, N, K, R, cn, fmt, _ = key
            assert [M, N, K, R] in prov["shapes"], (path.name, key)
            config = sweep.curve_config(key)          # the recorded `version` is the kernel's registry name
            assert (registry.spec_for(config).kernel, heuristics.cluster_size(config), registry.spec_for(config).fmt) == (v, cn, fmt)
            assert sorted(c) == list(range(sweep.min_stages(config), sweep.max_stages(config, jit.example_problem(registry.spec_for(config), M, N, K, R)) + 1)), (path.name, key)
            assert all(math.isclose(r["mfu"], r["tflops"] / peak, rel_tol=1e-9) for r in c.values())


def test_sweep_marks_lie_on_the_recorded_curves():
    rows = [r for _, _, rs in _records("sweep_stages") for r in rs]
    marks = sweep.sweep_marks(rows)
    assert marks, "no 2-CTA curve recorded"
    cs = sweep.curves(rows)
    for key, m in marks.items():
        assert set(m) == {repro.BUG, repro.FIX} and m["per_cta"] >= m["pair"]
        assert m["per_cta"] == max(cs[key])            # the fix picks the deepest point swept
        assert m["pair"] in cs[key]


def test_int4_pg_sweep_starts_at_two_stages():
    "The int4_pg mainloop holds two stages at once: one would deadlock, so the config refuses it and the sweep starts at 2."
    assert sweep.min_stages(configs.HopperPgConfig()) == 2 and sweep.min_stages(configs.HopperV2Config()) == 1
    with pytest.raises(ValueError, match="stages=1: the hopper_pg K-loop holds 2 stages at once"):
        smem.check_config(configs.HopperPgConfig(stages=1))
    with pytest.raises(ValueError, match="max_stages=1"):
        smem.check_config(configs.HopperPgConfig(max_stages=1))


def test_solver_marks_and_max_stages_take_configs():
    p = Problem(4352, 3072, 3840, 128)
    assert sweep.solver_marks(configs.HopperV2Config(cluster_n=2), p) == {"per_cta": 3, "pair": 1}
    assert sweep.solver_marks(configs.HopperV2Config(), p) == {"per_cta": 3, "pair": 3}      # one CTA: no pair, no bug
    assert sweep.max_stages(configs.HopperV1Config(stages=2), p) == 5   # the top of the sweep, not the pinned count
    assert sweep.SWEEP_CONFIGS == (configs.HopperV1Config(), configs.HopperV2Config())


def test_curves_reject_duplicates():
    _, _, rows = _records("sweep_stages")[0]
    with pytest.raises(ValueError, match="twice"):
        sweep.curves(rows + rows[:1])


def test_plot_sweep_and_table(tmp_path):
    rows = [r for _, _, rs in _records("sweep_stages") for r in rs]
    fig = sweep.plot_sweep(rows, sweep.sweep_marks(rows), tmp_path / "sweep.png", title="recorded")
    assert isinstance(fig, Figure) and (tmp_path / "sweep.png").stat().st_size > 0
    table = sweep.sweep_table(rows)
    assert table.count("\n") == len(sweep.curves(rows)) + 1


def test_plot_move_marks_the_original_move_on_the_recorded_curve(tmp_path):
    "The move of `LORA_MOVE_CONFIG` at R = 128 lands on points of the recorded int4_pg curve of its tile, and is 4 -> 2."
    rows = [r for p, _, rs in _records("sweep_stages") if "int4_pg" in p.name for r in rs]
    key = next(k for k in sweep.curves(rows) if k[5] == 2 and k[7] == repro.LORA_MOVE_CONFIG.tile_m)
    cfg = repro.LORA_MOVE_CONFIG
    move = sweep.solver_marks(cfg, jit.example_problem(registry.spec_for(cfg), *key[1:5]))
    assert move == {"per_cta": 4, "pair": 2} and set(move.values()) <= set(sweep.curves(rows)[key])
    pub = [(v[3], v[2], f"L = {v[0]}") for v in (records.citations()[f]["values"] for f in repro.PUBLISHED_SWEEP)]
    fig = sweep.plot_move(rows, key, move, pub, path=tmp_path / "move.png")
    assert isinstance(fig, Figure) and len(fig.axes) == 2 and (tmp_path / "move.png").stat().st_size > 0


# ---------------------------------------------------------------- the commands without a GPU
@pytest.fixture
def no_kernel(monkeypatch):
    "Take the no-GPU path even on a GPU machine: nothing is measured and nothing is written."
    monkeypatch.setattr(workloads, "kernel_unavailable", lambda config=None: "test: GPU path disabled")


def test_repro_cli_without_gpu_prints_the_story_then_the_move(no_kernel, capsys):
    "Without a GPU: the verdict, then the Hopper move, and the long tables only with --all."
    assert main(["repro", "lora-bug"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == repro.summary() == ("The LoRA fix: main stages 2 -> 4; 1.45x on one B200 "
                                                      "(the +198% compares a B300 with a B200)")
    story, move = out.index("+198%"), out.index("Hopper pairs where the bug moves")
    assert story < move and "1.45x" in out[:move] and "L=3 chunk 64" in out[move:]
    assert "Recorded measurements" not in out and "--all" in out
    assert main(["repro", "lora-bug", "--all"]) == 0
    out = capsys.readouterr().out
    assert out.index("Hopper pairs where") < out.index("re-solved budget, as published") < out.index("Recorded measurements")
    assert "v2 int4 2-CTA 128x128 R=128" in out
    for path, prov, _ in _records("lora_bug"):
        assert f"recorded: `{path.name}`" in out and f"Re-measure: `{prov['command']}`" in out


def test_repro_moves_command_names_itself():
    args = parser("repro").parse_args(["repro", "lora-bug", "--moves", "--iters", "20"])
    assert repro._command(args) == "w4a4-book repro lora-bug --moves --iters 20"


def test_sweep_cli_without_gpu_prints_recorded(no_kernel, capsys):
    assert main(["sweep-stages"]) == 0
    out = capsys.readouterr().out
    for path, prov, _ in _records("sweep_stages"):
        assert f"recorded: `{path.name}`" in out and f"Re-measure: `{records.remeasure(prov, path.name)}`" in out


def test_sweep_cli_rejects_a_bad_cluster(no_kernel, capsys):
    assert main(["sweep-stages", "--cluster-n", "3"]) == 2
    assert "cluster_n=3" in capsys.readouterr().err


def test_recorded_sweep_commands_still_parse():
    """A record's re-measure command names kernels by registry name (`--versions`) and the format its rows were swept
    in (`--fmt`: the records made when int4 was the default name none, and `records.remeasure` adds it), so it re-runs
    what was measured."""
    for path, prov, rows in _records("sweep_stages"):
        args = parser("sweep-stages").parse_args(records.remeasure(prov).split()[1:])
        assert {r.get("fmt", "int4") for r in rows} == {args.fmt}, path.name
        assert [registry.find_kernel(v, args.fmt).kernel for v in args.versions] == args.versions, path.name


def test_sweep_command_names_its_format():
    "A new record's command spells out `--fmt`, whatever the default, so a later change of default cannot re-type it."
    for argv in ([], ["--fmt", "int4"]):
        args = parser("sweep-stages").parse_args(["sweep-stages", *argv])
        cmd = sweep.command(args, ["v2"])
        assert f"--fmt {args.fmt}" in cmd and parser("sweep-stages").parse_args(cmd.split()[1:]).fmt == args.fmt
    assert parser("sweep-stages").parse_args(["sweep-stages"]).fmt == registry.DEFAULT_FMT == "int4_pg"


# ---------------------------------------------------------------- the GPU path, with the GPU faked
@pytest.fixture
def fake_gpu(monkeypatch):
    "Install a fake H200: workloads on the CPU, `launcher` for `gemm.gemm_launcher`, a timer that reads each launch's `ms`."
    real_make_workload = workloads.make_workload
    def install(launcher):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
        monkeypatch.setattr(workloads, "make_workload", lambda *a, **k: real_make_workload(*a, device="cpu", **k))
        monkeypatch.setattr(timing, "time_cuda", lambda fn, **k: timing.summarize_times([fn.ms] * k["iters"]))
        monkeypatch.setattr(gemm, "gemm_launcher", launcher)
    return install


def test_measure_lora_bug_rows_with_a_fake_gpu(fake_gpu):
    "The measurement's bookkeeping on the CPU: the kernel and the timer are stand-ins, everything else is real."
    from w4a4_book.reference import w4a4_gemm_ref
    ms = {repro.BUG: 2.0, repro.FIX: 1.0}

    def fake_launcher(*ops, out_dtype, config):
        assert (registry.spec_for(config).kernel, config.cluster_n) == ("v2", 2)
        assert replace(config, lora_accounting=repro.FIX) == repro.LORA_BUG_CONFIG   # only the accounting differs
        out = torch.empty(ops[0].rows, ops[1].rows, dtype=out_dtype)
        def launch(): out.copy_(w4a4_gemm_ref(*ops))
        launch.ms = ms[config.lora_accounting]
        return launch, out

    fake_gpu(fake_launcher)
    rows = repro.measure_lora_bug([(128, 256, 256, 128)], iters=20, quiet=True)
    assert [r["accounting"] for r in rows] == [repro.BUG, repro.FIX]
    assert [r["main_stages"] for r in rows] == [1, 2]          # K=256: two K-blocks cap the fix at 2
    assert all(r["fixed_over_bug"] == 2.0 and r["rel_err"] < 2 ** -8 for r in rows)
    assert math.isclose(rows[1]["mfu"], timing.tflops(128, 256, 256, 1.0) / timing.peak_for("NVIDIA H200"))
    assert "fixed/bug" in repro.lora_bug_table(rows)


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_accounting_modes_match_reference():
    "The bug cannot fail a correctness test: v2 2-CTA at 1 stage (bug) and 3 stages (fix) both match the reference."
    from test_kernels import check_against_ref, make_case
    M, N, K, R = 300, 1024, 1024, 128
    by_acct = {a: replace(repro.LORA_BUG_CONFIG, lora_accounting=a) for a in (repro.BUG, repro.FIX)}
    stages = {a: smem.solve(c, Problem(M, N, K, R)).stages["main"] for a, c in by_acct.items()}
    assert stages == {"per_cta": 3, "pair": 1}
    case = make_case(M, N, K, R, seed=6)
    for acct, config in by_acct.items():
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm.gemm_w4a4(*case, config=config, out=out)
        torch.cuda.synchronize()
        check_against_ref(out, case, torch.bfloat16)


def test_measure_ladder_rows_with_a_fake_gpu(fake_gpu):
    "The ladder's bookkeeping on the CPU: every rung per layer timed with its own config, in order."
    from w4a4_book.reference import w4a4_gemm_ref
    seen = []

    def fake_launcher(*ops, out_dtype, config):
        seen.append(config)
        out = torch.empty(ops[0].rows, ops[1].rows, dtype=out_dtype)
        def launch(): out.copy_(w4a4_gemm_ref(*ops))
        launch.ms = 1.0 + len(seen)
        return launch, out

    fake_gpu(fake_launcher)
    rows = repro.measure_ladder("int4_pg", [(256, 256, 256, 128)], iters=5, quiet=True)
    assert [r["rung"] for r in rows] == [n for n, _ in repro.LADDER["int4_pg"]]
    assert all(r["tflops"] is not None for r in rows)
    assert seen == [c for _, c in repro.LADDER["int4_pg"]]
    assert "not built" not in repro.ladder_table(rows) and all(r["rel_err"] < 2 ** -8 for r in rows)
