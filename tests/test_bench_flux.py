"""`w4a4-book bench-flux` (`nbs/20e_bench_flux.ipynb`): every path on CPU on the reduced model, a failing method kept
as a row with its error, the FP8 model built once for both FP8 methods, the record's provenance, the command without a
GPU, and on a GPU every method of a small model; skipped without diffusers."""
import argparse
import contextlib
import io
import warnings

import pytest

pytest.importorskip("diffusers")

from w4a4_book.bench import flux as bench_flux
from w4a4_book.bench.workloads import kernel_unavailable
from w4a4_book.flux import FLUX_SMALL
from w4a4_book.records import load_record, save_record

CPU = dict(config=FLUX_SMALL, resolutions=(32,), text_tokens=16, device="cpu", compile_backend="aot_eager")


def _run(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bench_flux.run_flux_bench(bench_flux.FluxRun(**{**CPU, **kw}), quiet=True)


def test_cpu_stand_in_times_by_the_host_and_profiles():
    rows = _run(methods=("bf16_eager", "w4a4_graph"))
    assert [r["method"] for r in rows] == ["bf16_eager", "w4a4_graph"]
    assert all(r["median_ms"] > 0 and r["n"] == 20 and not r["graph"] for r in rows)
    assert rows[0]["rel_err"] == 0 and 0 < rows[1]["rel_err"] < 0.1 and rows[1]["convert_s"] > 0
    assert all(abs(r["attention_share"] + r["linear_share"] + r["other_share"] - 1) < 1e-9 for r in rows)
    assert rows[1]["top_kernels"] and rows[1]["weight_gb"] < rows[0]["weight_gb"]


def test_a_failing_method_leaves_its_error_and_the_others_run(monkeypatch):
    def broken(model):
        raise RuntimeError("no FP8 here")
    monkeypatch.setattr(bench_flux, "to_fp8", broken)
    rows = _run(methods=("fp8_compiled", "w4a8_graph"), fp8="book", timed=False)
    assert rows[0]["error"] == "RuntimeError: no FP8 here" and "median_ms" not in rows[0]
    assert "error" not in rows[1] and rows[1]["rel_err"] < 0.1
    assert "RuntimeError: no FP8 here" in bench_flux.flux_table(rows)


def test_fp8_graph_times_the_fp8_model_built_once_and_a_failed_capture_is_a_row(monkeypatch):
    built, to_fp8, measured = [], bench_flux.to_fp8, bench_flux.measure
    def counted(model):
        built.append(model)
        return to_fp8(model)
    def no_capture(call, ref, graph, run):         # on CPU nothing is captured: a capture that raises stands in
        if graph:
            raise RuntimeError("operation not permitted when stream is capturing")
        return measured(call, ref, graph, run)
    monkeypatch.setattr(bench_flux, "to_fp8", counted)
    monkeypatch.setattr(bench_flux, "measure", no_capture)
    rows = _run(methods=("fp8_graph", "bf16_eager", "fp8_compiled"), fp8="book", timed=False)
    assert [r["method"] for r in rows] == ["bf16_eager", "fp8_compiled", "fp8_graph"] and len(built) == 1
    assert "error" not in rows[1] and rows[2]["error"].startswith("RuntimeError: operation not permitted")
    assert all(rows[2][k] == rows[1][k] for k in ("fp8_impl", "convert_s", "weight_gb"))


def test_provenance_makes_a_valid_record(tmp_path):
    prov = bench_flux.flux_provenance(bench_flux.FluxRun(resolutions=(512,), methods=("w4a4_graph",)))
    path = save_record(tmp_path / "flux_test.json", prov, [dict(method="w4a4_graph", resolution=512, median_ms=1.0)])
    got, rows = load_record(path)
    assert got["kind"] == "flux" and got["shapes"] == [[512, 1024, 512]] and got["config"]["num_layers"] == 19
    assert "diffusers" in got and "torchao" in got and rows[0]["median_ms"] == 1.0


def _records(tmp_path, monkeypatch, runs):
    "`recorded_flux_rows()` of records made of `runs`, `(name, gpu, date, {method: ms})` each, at 1024."
    prov = bench_flux.flux_provenance(bench_flux.FluxRun(resolutions=(1024,)))
    for name, gpu, date, times in runs:
        save_record(tmp_path / f"flux_{name}.json", {**prov, "gpu": gpu, "date": date},
                    [dict(method=m, resolution=1024, median_ms=t) for m, t in times.items()])
    monkeypatch.setattr("w4a4_book.records.data_dir", lambda: tmp_path)
    return bench_flux.recorded_flux_rows()


def test_recorded_rows_are_newest_per_card(tmp_path, monkeypatch):
    rows, runs = _records(tmp_path, monkeypatch, [("a", "NVIDIA H200", "2026-01-01", {"w4a4_graph": 3.0}),
                                                  ("b", "NVIDIA H100 80GB HBM3", "2026-02-01", {"w4a4_graph": 4.0}),
                                                  ("c", "NVIDIA H200", "2026-03-01", {"w4a4_graph": 2.0})])
    assert [(r["gpu"], r["median_ms"], r["record"]) for r in rows] == [("H100", 4.0, "flux_b.json"),
                                                                       ("H200", 2.0, "flux_c.json")]
    assert [name for name, _ in runs] == ["flux_c.json", "flux_b.json", "flux_a.json"]


def test_targets_never_divide_rows_of_two_cards(tmp_path, monkeypatch):
    "bf16 only on the H200, W4A4 only on the H100: no ratio between them, '—' on each card."
    rows, _ = _records(tmp_path, monkeypatch, [("a", "NVIDIA H200", "2026-01-01", {"bf16_compiled": 9.0}),
                                               ("b", "NVIDIA H100 80GB HBM3", "2026-02-01", {"w4a4_graph": 1.0})])
    targets = bench_flux.flux_targets(rows)
    assert {t["GPU"] for t in targets} == {"H100", "H200"} and len(targets) == 2 * len(bench_flux.FLUX_TARGETS)
    assert all(t["measured"] == "—" and t["met"] == "—" for t in targets)
    with pytest.raises(ValueError, match="gpu must name one card"):
        bench_flux.plot_flux([{**r, "profiled_ms": 1.0, "top_kernels": [["gemm", 1.0, 1]]} for r in rows])


def test_command_without_a_gpu_prints_one_line_then_the_records():
    p = argparse.ArgumentParser()
    bench_flux.add_arguments(p)
    if kernel_unavailable() is None:
        pytest.skip("a GPU the kernels run on: the command would measure")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench_flux.run(p.parse_args(["--res", "512"])) == 0
    assert out.getvalue().startswith("Nothing is measured here (")


@pytest.mark.gpu
@pytest.mark.skipif(kernel_unavailable() is not None, reason="needs a GPU the sm_90 kernels run on")
def test_small_model_every_method_on_gpu():
    run = bench_flux.FluxRun(config=FLUX_SMALL, resolutions=(256,), text_tokens=64, methods=bench_flux.FLUX_METHODS)
    rows = bench_flux.run_flux_bench(run, quiet=True)
    assert [r["method"] for r in rows] == list(bench_flux.FLUX_METHODS)
    assert all("error" not in r and r["median_ms"] > 0 and r["rel_err"] < 0.1 for r in rows), rows
    assert [r["graph"] for r in rows] == [m in bench_flux.GRAPH_METHODS for m in bench_flux.FLUX_METHODS]
    assert rows[3]["method"] == "fp8_graph" and rows[3]["first_call_s"] < rows[2]["first_call_s"]   # compiled once
