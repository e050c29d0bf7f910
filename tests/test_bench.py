"""Tests of the benchmark harness `w4a4_book.bench`: timing arithmetic (`timing`), shapes, workloads, baselines on CPU
and the method registry (`workloads`), the floor check, tables and README text (`report`), and one GPU run."""
import argparse
import ast
import json
from functools import partial
from pathlib import Path

import pytest
import torch

from w4a4_book import gemm
from w4a4_book.bench import report, timing, workloads
from w4a4_book.bench.report import (LORA_RECORD, README_RECORDS, bench_table, check_floors, large_m, lora_line,
                                    mfu_floors, plot_bench, ratio_table, readme_results, readme_table, record_line,
                                    speedups, standing)
from w4a4_book.bench.timing import GPU_PEAKS, mfu, peak_for, rel_err, summarize_times, tflops, time_cuda
from w4a4_book.bench.workloads import (DIAGNOSTICS, KERNELS, METHODS, Method, Workload, bench_problems, byte_table,
                                       dequantize_bf16, kernel_method, make_workload, naive_dequant, torch_bf16,
                                       torch_fp8_rowwise)
from w4a4_book.formats import dequantize, quantize
from w4a4_book.operands import Problem
from w4a4_book.records import data_dir, load_record, provenance, save_record
from w4a4_book.reference import w4a4_gemm_ref
from w4a4_book.smem import HopperV1Config, HopperV2Config

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")


def test_shapes_exactly_as_specified():
    kn = [(3840, 3072), (3840, 15360), (15360, 3840), (10240, 3072)]
    expected = ([(4352, n, k, r) for k, n in kn for r in (32, 128)] + [(256, n, k, 32) for k, n in kn]
                + [(8192, 8192, 8192, 32)])
    assert bench_problems() == expected
    assert bench_problems("all") == bench_problems("m4352") + bench_problems("m256") + bench_problems("8192")
    assert bench_problems("8192", ranks=[32, 128]) == [(8192, 8192, 8192, 32), (8192, 8192, 8192, 128)]
    for bad in ("m512", None):
        with pytest.raises(ValueError, match="which"):
            bench_problems(bad)
    with pytest.raises(ValueError, match="ranks"):
        bench_problems(ranks=[])


def test_tflops_and_mfu_arithmetic():
    assert tflops(8192, 8192, 8192, 1.0) == pytest.approx(1099.511627776)
    assert tflops(4352, 3072, 3840, 2.0) == pytest.approx(2 * 4352 * 3072 * 3840 / 2e-3 / 1e12)
    assert mfu(1979.0, "NVIDIA H200") == pytest.approx(1.0)
    assert mfu(989.5, "NVIDIA H100 80GB HBM3") == pytest.approx(0.5)
    assert mfu(4500.0, "NVIDIA B200", "nvfp4") == pytest.approx(0.5)
    for args, name in [((8192, 8192, 8192, 0.0), "ms"), ((8192, 8192, 8192, -1.0), "ms"), ((0, 1, 1, 1.0), "M"),
                       ((1, 1.5, 1, 1.0), "N")]:
        with pytest.raises(ValueError, match=name):
            tflops(*args)


@pytest.mark.parametrize("name,dtype,peak", [
    ("NVIDIA H100 80GB HBM3", "fp8", 1979.0), ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
    ("NVIDIA H200", "fp8", 1979.0), ("NVIDIA H100 PCIe", "fp8", 1513.0), ("NVIDIA H100 NVL", "fp8", 1670.5),
    ("NVIDIA H200 NVL", "bf16", 835.5), ("NVIDIA B200", "fp8", 4500.0), ("NVIDIA B200", "nvfp4", 9000.0)])
def test_peak_lookup(name, dtype, peak):
    assert peak_for(name, dtype) == peak


def test_peak_table_is_dense_and_consistent():
    for key, peaks in GPU_PEAKS.items():
        # FP8 tensor cores run at twice the bf16 rate on all of these; the datasheets round each figure on its own
        assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=1e-3), key


@pytest.mark.parametrize("name", ["NVIDIA A100-SXM4-80GB", "NVIDIA GH200 480GB", "", "H2000"])
def test_peak_lookup_unknown_gpu(name):
    with pytest.raises(ValueError, match="gpu_name"):
        peak_for(name)


def test_peak_lookup_errors():
    with pytest.raises(ValueError, match="dtype"):
        peak_for("NVIDIA H200", "nvfp4")
    with pytest.raises(TypeError, match="gpu_name"):
        peak_for(None)


def test_summarize_times():
    s = summarize_times([5.0] * 10 + [1.0] * 10 + [100.0])
    assert s["median_ms"] == 5.0 and s["n"] == 21 and s["p10_ms"] == 1.0 and s["p90_ms"] == 5.0
    with pytest.raises(ValueError, match="times_ms"):
        summarize_times([])


@needs_no_cuda
def test_time_cuda_refuses_cpu():
    with pytest.raises(RuntimeError, match="CUDA device"):
        time_cuda(lambda: None)


def test_time_cuda_validates_before_running():
    calls = []
    with pytest.raises(ValueError, match="iters"):
        time_cuda(lambda: calls.append(1), iters=19)
    with pytest.raises(ValueError, match="warmup"):
        time_cuda(lambda: calls.append(1), warmup=-1)
    assert calls == []


def test_make_workload():
    p = make_workload(64, 32, 128, 16, device="cpu", seed=3)
    assert p.shape == (64, 32, 128, 16)
    assert p.act.shape == (64, 128) and p.wgt.shape == (32, 128)
    assert p.lora_act.dtype == p.lora_up.dtype == p.wcscales.dtype == p.bias.dtype == torch.bfloat16
    assert (p.wcscales > 0).all() and (p.bias != 0).any()
    q = make_workload(64, 32, 128, 16, device="cpu", seed=3)
    assert torch.equal(p.act.data, q.act.data) and torch.equal(p.bias, q.bias)
    assert not torch.equal(p.bias, make_workload(64, 32, 128, 16, device="cpu", seed=4).bias)
    assert isinstance(p, Workload) and p.problem == Problem(64, 32, 128, 16)   # the operands' Problem, as gemm_w4a4 sees it
    for kwargs, name in [(dict(M=0), "M"), (dict(K=96), "K=96"), (dict(R=8), "R=8"), (dict(fmt="int8"), "fmt"),
                         (dict(out_dtype=torch.float32), "out_dtype")]:
        args = dict(M=64, N=32, K=128, R=16, device="cpu") | kwargs
        with pytest.raises(ValueError, match=name):
            make_workload(**args)


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_dequantize_bf16_matches_dequantize(fmt):
    q = quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(0)), fmt)
    ref = dequantize(q)
    out = dequantize_bf16(q, byte_table(fmt, "cpu"))
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=0)   # two bf16 roundings: the scale, the product


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
@pytest.mark.parametrize("method", [torch_bf16, naive_dequant])
def test_cpu_baselines_match_reference(method, fmt):
    p = make_workload(96, 80, 256, 32, fmt=fmt, device="cpu", seed=1)
    ref = w4a4_gemm_ref(*p.operands)
    out = method(p)()
    assert out.dtype == torch.bfloat16 and out.shape == (96, 80)
    assert rel_err(out, ref) < 1e-2


def test_fp8_baseline_needs_cuda_tensors():
    with pytest.raises(RuntimeError, match="device"):
        torch_fp8_rowwise(make_workload(64, 32, 128, 16, device="cpu"))


def test_rel_err():
    ref = torch.ones(4, 4)
    assert rel_err(ref.clone(), ref) == 0.0
    assert rel_err(2 * ref, ref) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="shape"):
        rel_err(ref[:2], ref)


def test_methods_registry():
    assert list(METHODS)[:3] == ["torch_bf16", "torch_fp8_rowwise", "naive_dequant"]
    assert not any(METHODS[m].kernel or METHODS[m].config is not None for m in ("torch_bf16", "torch_fp8_rowwise", "naive_dequant"))
    assert all(METHODS[m].kernel for m in ("w4a4_v1", "w4a4_v1_2cta", "w4a4_v2", "w4a4_v2_2cta"))
    # each kernel method is a config object, passed whole to the host layer
    assert {m.name: m.config for m in KERNELS} == {
        "w4a4_v1": HopperV1Config(), "w4a4_v1_2cta": HopperV1Config(cluster_n=2),
        "w4a4_v2": HopperV2Config(), "w4a4_v2_2cta": HopperV2Config(cluster_n=2)}
    diag = {m.name: m.config for m in DIAGNOSTICS if m.config is not None}
    assert diag == {"w4a4_v2_pure": HopperV2Config(), "w4a4_v2_i2f": HopperV2Config(promotion="i2f"),
                    "w4a4_v2_no_decode": HopperV2Config(ablate=("decode",)),
                    "w4a4_v2_no_promote": HopperV2Config(ablate=("promote",)),
                    "w4a4_v2_mma_only": HopperV2Config(ablate=("decode", "promote"))}
    assert [m.name for m in DIAGNOSTICS if m.checked] == ["w4a4_v2_i2f"]   # the ablations compute wrong results on purpose


def test_kernel_method_checks_its_config():
    with pytest.raises(ValueError, match="cluster_n=4"):
        kernel_method("w4a4_v2_4cta", HopperV2Config(cluster_n=4))
    with pytest.raises(ValueError, match="promotion='fp32'"):
        kernel_method("w4a4_v2_x", HopperV2Config(promotion="fp32"))
    with pytest.raises(TypeError, match="config"):
        kernel_method("w4a4_v3", "v3")


def test_kernel_method_launches_its_config(monkeypatch):
    "The method hands its config, whole, to `gemm.gemm_launcher`, with the workload's operands and output dtype."
    seen = {}
    def fake_launcher(*ops, out_dtype, config):
        seen.update(n_ops=len(ops), out_dtype=out_dtype, config=config)
        out = torch.zeros(ops[0].rows, ops[1].rows, dtype=out_dtype)
        return (lambda: None), out
    monkeypatch.setattr(gemm, "gemm_launcher", fake_launcher)
    w = make_workload(64, 128, 128, 16, device="cpu")
    cfg = HopperV2Config(cluster_n=2, promotion="i2f")
    out = kernel_method("k", cfg).build(w)()
    assert seen == dict(n_ops=6, out_dtype=torch.bfloat16, config=cfg) and out.shape == (64, 128)
    workloads.pure_kernel_method("p", cfg).build(w)()
    assert seen["n_ops"] == 2 and seen["config"] == cfg          # the main GEMM alone: act and wgt


def test_budget_of_a_kernel_method():
    "The stages a kernel method runs with are the solver's for its config bound to the workload's problem."
    from w4a4_book import smem
    p = make_workload(64, 128, 3840, 128, device="cpu").problem
    stages = {m.name: smem.solve(gemm.bind(m.config, p), k=p.K).stages["main"] for m in KERNELS}
    assert stages["w4a4_v2"] == stages["w4a4_v2_2cta"] == 3      # the fix: a pair charges each CTA its half of LU


def test_kernel_unavailable_names_the_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert workloads.kernel_unavailable() == "no CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert workloads.kernel_unavailable(HopperV1Config()) == ("the sm_90a kernels need compute capability 9.0, "
                                                              "this device has 10.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert workloads.kernel_unavailable(HopperV2Config(cluster_n=2)) is None


def test_modules_import_one_way():
    "report -> workloads -> timing, never back; the layer benchmark uses the harness, and nothing in it imports the layer's benchmark."
    pkg = Path(workloads.__file__).parent
    def deps(name):
        tree = ast.parse((pkg / f"{name}.py").read_text())
        return {n.module.split(".")[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1}
    assert deps("timing") == set()
    assert deps("workloads") == {"timing"}
    assert deps("report") == {"timing", "workloads"}
    assert deps("layer") == {"timing", "workloads"}


def _row(method="w4a4_v1", kernel=True, M=256, N=3072, K=3840, R=32, tf=None, m=None, **kw):
    "A made-up row to exercise the table, plot and floor logic; not a measurement."
    return dict(method=method, kernel=kernel, fmt="int4", M=M, N=N, K=K, R=R, median_ms=None if tf is None else 1.0,
                tflops=tf, mfu=m, rel_err=None if tf is None else 1e-3, note=None if tf is not None else "skipped") | kw


def test_floors_and_check():
    recorded = [_row(tf=900.0, m=0.5), _row(method="torch_bf16", kernel=False, tf=500.0, m=0.25),
                _row(R=128, tf=800.0, m=0.4)]
    assert mfu_floors(recorded) == {("w4a4_v1", "int4", 256, 3072, 3840, 32): pytest.approx(0.45),
                                    ("w4a4_v1", "int4", 256, 3072, 3840, 128): pytest.approx(0.36)}
    assert check_floors([_row(tf=850.0, m=0.46), _row(method="torch_bf16", kernel=False, tf=1.0, m=0.01)],
                        recorded) == []
    slow = check_floors([_row(tf=700.0, m=0.44), _row(R=128, tf=800.0, m=0.4)], recorded)
    assert len(slow) == 1 and "w4a4_v1 256x3072x3840 R=32" in slow[0] and "44.0%" in slow[0]
    assert "did not run" in check_floors([_row()], recorded)[0]
    assert "nothing was checked" in check_floors([_row(M=4352, tf=1.0, m=0.5)], recorded)[0]
    with pytest.raises(ValueError, match="fraction"):
        mfu_floors(recorded, fraction=0.0)


def test_table_and_plot(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    rows = [_row(method="torch_bf16", kernel=False, tf=500.0, m=0.25), _row(tf=900.0, m=0.5),
            _row(method="torch_bf16", kernel=False, M=4352, tf=600.0, m=0.3), _row(M=4352)]
    table = bench_table(rows).splitlines()
    assert table[0] == "| M×N×K | R | torch_bf16 | w4a4_v1 |"
    assert table[2] == "| 256×3072×3840 | 32 | 500 | 900 |" and table[3] == "| 4352×3072×3840 | 32 | 600 | — |"
    assert "50.0%" in bench_table(rows, "mfu")
    with pytest.raises(ValueError, match="value"):
        bench_table(rows, "speed")
    fig = plot_bench(rows, title="made-up rows")
    fig.savefig(tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no timed row"):
        plot_bench([_row()])


def _parser():
    p = argparse.ArgumentParser()
    report.add_arguments(p)
    return p


def test_cli_command_round_trip():
    args = _parser().parse_args(["--shapes", "m4352", "--ranks", "32", "--iters", "30"])
    command = report._command(args)
    assert command.startswith("w4a4-book bench --shapes m4352 --methods torch_bf16 ")
    assert _parser().parse_args(command.split()[2:]) == args
    with pytest.raises(SystemExit):
        _parser().parse_args(["--methods", "no_such_method"])


@needs_no_cuda
def test_cli_refuses_cpu():
    with pytest.raises(RuntimeError, match="CUDA device"):
        report.bench_cli(["--shapes", "8192", "--iters", "20"])


@pytest.fixture
def fake_h200(monkeypatch):
    "Run the harness's control flow on the CPU: device queries answer as an H200, workloads live on the CPU, timing is stubbed."
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(workloads, "make_workload", partial(make_workload, device="cpu"))
    monkeypatch.setattr(workloads, "time_cuda", lambda fn, **kw: dict(median_ms=1.0, p10_ms=0.9, p90_ms=1.2, n=kw["iters"]))
    monkeypatch.setattr(workloads, "kernel_unavailable", lambda config=None: "no sm_90 device in this test")
    return monkeypatch


def test_run_bench_rows(fake_h200):
    wrong = Method("wrong", lambda p: lambda: torch.zeros(p.shape[:2], dtype=torch.bfloat16))
    rows = workloads.run_bench([(64, 128, 128, 16), (32, 64, 256, 32)], ["torch_bf16", "w4a4_v1", wrong], iters=20,
                           quiet=True)
    assert [(r["method"], r["M"]) for r in rows] == [(m, M) for M in (64, 32) for m in ("torch_bf16", "w4a4_v1", "wrong")]
    bf16, kernel, bad = rows[:3]
    assert bf16["tflops"] == pytest.approx(tflops(64, 128, 128, 1.0)) and bf16["n"] == 20
    assert bf16["mfu"] == pytest.approx(bf16["tflops"] / 1979.0) and bf16["rel_err"] < 1e-2 and bf16["note"] is None
    assert kernel["kernel"] and kernel["tflops"] is None and kernel["note"] == "no sm_90 device in this test"
    assert bad["rel_err"] == pytest.approx(1.0)
    assert workloads.run_bench([(64, 128, 128, 16)], ["torch_bf16"], iters=20, check=False, quiet=True)[0]["rel_err"] is None


def test_run_bench_asks_about_each_kernel_config(fake_h200):
    "Whether a kernel can run is asked of its own config; the baselines are never asked."
    asked = []
    fake_h200.setattr(workloads, "kernel_unavailable", lambda config=None: asked.append(config) or f"not {config.cluster_n}")
    rows = workloads.run_bench([(64, 128, 128, 16)], ["torch_bf16", "w4a4_v2", "w4a4_v2_2cta"], iters=20, quiet=True)
    assert asked == [HopperV2Config(), HopperV2Config(cluster_n=2)]
    assert [r["note"] for r in rows] == [None, "not 1", "not 2"]


def test_run_bench_rejections(fake_h200):
    def reject(p):
        raise ValueError("R=16 is not supported")
    fake_h200.setattr(workloads, "kernel_unavailable", lambda config=None: None)
    row = workloads.run_bench([(64, 128, 128, 16)], [Method("k", reject, kernel=True)], iters=20, quiet=True)[0]
    assert row["tflops"] is None and row["note"] == "ValueError: R=16 is not supported"
    with pytest.raises(ValueError, match="not supported"):   # a baseline that fails is a bug, not a gap
        workloads.run_bench([(64, 128, 128, 16)], [Method("b", reject)], iters=20, quiet=True)
    with pytest.raises(ValueError, match="iters"):
        workloads.run_bench([(64, 128, 128, 16)], ["torch_bf16"], iters=10)
    with pytest.raises(ValueError, match="no_such"):
        workloads.run_bench([(64, 128, 128, 16)], ["no_such"])
    fake_h200.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="gpu_name"):
        workloads.run_bench([(64, 128, 128, 16)], ["torch_bf16"])


def test_cli_save_then_check(fake_h200, tmp_path, capsys):
    fake_h200.setattr(report, "bench_problems", lambda which, ranks: [(64, 128, 128, 16)])
    fake_h200.setattr(workloads, "kernel_unavailable", lambda config=None: None)
    fake_h200.setitem(workloads.METHODS, "w4a4_v1", Method("w4a4_v1", torch_bf16, kernel=True))   # a stand-in kernel
    common = ["--shapes", "m256", "--methods", "torch_bf16", "w4a4_v1", "--iters", "20"]
    record = tmp_path / "bench_h200_test.json"
    assert report.bench_cli(common + ["--out", str(record)]) == 0
    prov, rows = load_record(record)
    assert prov["command"] == "w4a4-book bench " + " ".join(common[:-2] + ["--fmt", "int4", "--iters", "20", "--warmup", "10"])
    assert prov["mfu_peak_tflops"] == 1979.0 and [r["method"] for r in rows] == ["torch_bf16", "w4a4_v1"]
    assert report.bench_cli(common + ["--check", "--baseline", str(record)]) == 0
    fake_h200.setattr(workloads, "time_cuda", lambda fn, **kw: dict(median_ms=2.0, p10_ms=1.9, p90_ms=2.1, n=kw["iters"]))
    capsys.readouterr()
    assert report.bench_cli(common + ["--check", "--baseline", str(record)]) == 1
    err = capsys.readouterr().err
    assert "FAIL w4a4_v1 64x128x128 R=16 (int4)" in err and "torch_bf16" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_h200_test.json"]   # --check saved nothing


@pytest.mark.gpu
def test_fp8_rowwise_on_gpu():
    p = make_workload(256, 512, 1024, 32, device="cuda")
    out = torch_fp8_rowwise(p)()
    assert out.dtype == torch.bfloat16 and out.shape == (256, 512)
    assert rel_err(out, w4a4_gemm_ref(*p.operands)) < 1e-1   # row-wise FP8 re-quantization of 4-bit values


@pytest.mark.gpu
def test_one_shape_end_to_end(tmp_path):
    rows = workloads.run_bench([(256, 3072, 3840, 32)], iters=20, warmup=2, quiet=True)
    assert [r["method"] for r in rows] == list(METHODS)
    gpu = torch.cuda.get_device_name()
    for r in rows:
        if r["kernel"] and r["tflops"] is None:
            assert r["note"], r   # a kernel that did not run says why
            continue
        assert r["median_ms"] > 0 and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"] and r["n"] == 20
        assert r["tflops"] == pytest.approx(tflops(256, 3072, 3840, r["median_ms"]))
        assert r["mfu"] == pytest.approx(r["tflops"] / peak_for(gpu))
        assert r["rel_err"] < (1e-1 if r["method"] == "torch_fp8_rowwise" else 1e-2), r
    path = report.save_bench(rows, tmp_path / "bench_test.json", command="pytest tests/test_bench.py")
    prov, back = load_record(path)
    assert prov["gpu"] == gpu and prov["kind"] == "bench" and back == json.loads(json.dumps(rows))
    ran = any(r["kernel"] and r["mfu"] is not None for r in rows)
    assert check_floors(rows, back) == ([] if ran else ["no kernel row of this run has a recorded floor; nothing was checked"])


def _large(tf_by_method, M=4352, **kw):
    "Made-up rows of one problem, one per method: not measurements."
    return [_row(method=m, kernel=m.startswith("w4a4"), M=M, tf=t, m=None if t is None else t / 1979.0, **kw)
            for m, t in tf_by_method.items()]


def test_speedups_and_ratio_table():
    rows = (_large({"w4a4_v1": 200.0, "w4a4_v2": 300.0, "torch_fp8_rowwise": 600.0})
            + _large({"w4a4_v1": 100.0, "w4a4_v2": None, "torch_fp8_rowwise": 400.0}, R=128))
    assert speedups(rows, "w4a4_v2", "w4a4_v1") == {(4352, 3072, 3840, 32): pytest.approx(1.5)}
    pairs = [("w4a4_v2", "w4a4_v1"), ("w4a4_v2", "torch_fp8_rowwise")]
    table = ratio_table(rows, pairs).splitlines()
    assert table[0] == "| M×N×K | R | w4a4_v2 / w4a4_v1 | w4a4_v2 / torch_fp8_rowwise |"
    assert table[2:] == ["| 4352×3072×3840 | 32 | 1.50× | 0.50× |", "| 4352×3072×3840 | 128 | — | — |"]
    for args, name in [(("w4a4_v3", "w4a4_v1"), "method='w4a4_v3'"), (("w4a4_v2", "torch_bf16"), "over='torch_bf16'")]:
        with pytest.raises(ValueError, match=name):
            speedups(rows, *args)
    with pytest.raises(ValueError, match="over='naive_dequant'"):
        ratio_table(rows)   # the default pairs need methods these rows lack


def test_readme_table_and_standing():
    methods = {"torch_bf16": 600.0, "torch_fp8_rowwise": 900.0, "naive_dequant": 250.0, "w4a4_v1": 300.0,
               "w4a4_v2": 450.0, "w4a4_v2_2cta": 460.0}
    rows = _large(methods, M=256) + _large(methods) + _large({**methods, "w4a4_v2": 480.0}, M=8192, N=8192, K=8192)
    assert [r["M"] for r in large_m(rows)] == [4352] * 6 + [8192] * 6
    table = readme_table(rows).splitlines()
    assert table[0] == "| M×N×K | R | torch bf16 | torch FP8 rowwise | v1 | v2 | v2 2-CTA | v2 MFU |"
    assert table[2:] == ["| 4352×3072×3840 | 32 | 600 | 900 | 300 | 450 | 460 | 22.7% |",
                         "| 8192×8192×8192 | 32 | 600 | 900 | 300 | 480 | 460 | 24.3% |"]
    s = standing(rows)
    assert "v2 runs at 450–480 TFLOP/s, 22.7%–24.3% of the dense FP8 peak" in s
    assert "1.50–1.60× v1 (300)" in s and "0.50–0.53× PyTorch's FP8" in s and "0.75–0.80× its bf16 path (600)" in s
    with pytest.raises(ValueError, match="M in"):
        readme_table(_large(methods, M=256))


def test_record_line():
    prov = provenance("w4a4-book bench --shapes 8192", [[8192, 8192, 8192, 32]])
    line = record_line("bench_x.json", prov)
    assert line.startswith("`bench_x.json`: ") and line.endswith("Re-measure: `w4a4-book bench --shapes 8192`")
    with pytest.raises(ValueError, match="command"):
        record_line("bench_x.json", {**prov, "command": ""})


def test_lora_line():
    rows = [dict(R=r, accounting=a, main_stages=s, fixed_over_bug=x)
            for r, a, s, x in [(128, "pair", 1, 1.2), (128, "per_cta", 3, 1.2), (128, "pair", 2, 1.05),
                               (128, "per_cta", 3, 1.05)]]
    assert lora_line(rows) == "R = 128: main stages 1–2 with the bug (`pair`) against 3 fixed (`per_cta`), fixed/bug 1.05–1.20×."
    with pytest.raises(ValueError, match="both accountings"):
        lora_line(rows[::2])
    with pytest.raises(ValueError, match="non-empty"):
        lora_line([])


def test_readme_results_from_another_folder(tmp_path):
    for name in README_RECORDS + (LORA_RECORD,):
        prov, rows = load_record(data_dir()/name)
        if name == README_RECORDS[0]:
            rows = [{**r, "tflops": 2 * r["tflops"]} if r["method"] == "w4a4_v2" and r["M"] == 8192 else r for r in rows]
        save_record(tmp_path/name, prov, rows)
    assert readme_results(tmp_path) != readme_results()
    assert readme_results(tmp_path).count("Re-measure: `") == 3


@pytest.mark.gpu
def test_time_cuda_graph_replays_the_work():
    "`graph=True` times replays of one capture; the replay really computes, and a host sync refuses to be captured."
    x = torch.randn(512, 512, device="cuda")
    y = torch.empty_like(x)
    t = time_cuda(lambda: torch.mm(x, x, out=y), warmup=2, iters=20, graph=True)
    assert t["n"] == 20 and t["median_ms"] > 0
    replay = timing.cuda_graph(lambda: torch.mm(x, x, out=y))
    y.zero_()
    replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x @ x)
    with pytest.raises(RuntimeError):
        timing.cuda_graph(lambda: x.sum().item())
