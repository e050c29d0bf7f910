"""Tests of the benchmark harness `w4a4_book.bench`: timing arithmetic (`timing`), shapes, workloads (int4, int4_pg,
W4A8), baselines on CPU, the method registry with its lazily looked-up kernels, the stock GEMMs compiled without a GPU
(`workloads`), the floor check, the int4_pg targets, tables and README text (`report`), and the GPU runs."""
import argparse
import ast
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from w4a4_book import act_quant, heuristics, jit, registry, gemm
from w4a4_book.bench import layer as bench_layer
from w4a4_book.bench import report, timing, workloads
from w4a4_book.bench.report import (ACTIVATION_README_RECORD, LAYER_README_RECORDS, LORA_RECORD, MOVES_RECORD, PG_README_RECORDS, README_RECORDS, WAVES_RECORD, bench_table, check_floors, large_m, lora_line,
                                    mfu_floors, plot_bench, ratio_table, readme_results, readme_table, record_line,
                                    speedups, standing)
from w4a4_book.bench.timing import GPU_PEAKS, mfu, peak_for, rel_err, summarize_times, tflops, time_cuda
from w4a4_book.bench.workloads import (ALL_METHODS, DIAGNOSTICS, KERNELS, METHODS, PG_KERNEL, PG_KERNELS, KernelRef,
                                       Method, Workload, bench_problems, byte_table, default_methods, dequantize_bf16,
                                       kernel_method, make_workload, naive_dequant, torch_bf16, torch_fp8_rowwise)
from w4a4_book.formats import dequantize, quantize
from w4a4_book.operands import Problem
from w4a4_book.records import data_dir, list_records, load_record, provenance, save_record
from w4a4_book.reference import w4a4_gemm_ref
from w4a4_book.configs import HopperV1Config, HopperV2Config

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


def test_m1024_is_a_named_set_outside_all():
    "M=1024 at the four layers, rank 32: named by `--shapes m1024` (bench and bench-layer), never part of `all`."
    kn = [(3840, 3072), (3840, 15360), (15360, 3840), (10240, 3072)]
    assert bench_problems("m1024") == [(1024, n, k, 32) for k, n in kn]
    assert 1024 not in {M for M, *_ in bench_problems()}
    args = _parser().parse_args(["--shapes", "m1024"])
    assert bench_problems(args.shapes, args.ranks) == bench_problems("m1024") and report._tag(args) == "int4_pg_m1024"
    assert bench_layer.layer_shapes("m1024") == [(1024, k, n) for k, n in kn]
    assert bench_layer.layer_shapes() == [s for name in ("m4352", "m256", "m1024") for s in bench_layer.layer_shapes(name)]


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
    for kwargs, name in [(dict(M=0), "M"), (dict(K=96), "K=96"), (dict(R=8), "R=8"), (dict(fmt="int2"), "fmt"),
                         (dict(out_dtype=torch.float32), "out_dtype"), (dict(fmt="int4_pg", K=96), "K=96"),
                         (dict(fmt="int8", K=160000), "K=160000")]:
        args = dict(M=64, N=32, K=128, R=16, device="cpu") | kwargs
        with pytest.raises(ValueError, match=name):
            make_workload(**args)


@pytest.mark.parametrize("fmt", ["int4_pg", "int8"])
def test_make_workload_integer_formats(fmt):
    "int4_pg: int8-packed activations (q·u, no u) as the activation kernel writes them, nibble weights; int8: W4A8."
    p = make_workload(64, 32, 128, 16, fmt=fmt, device="cpu", seed=3)
    act_fmt = {"int4_pg": "int4_pg", "int8": "int8"}[fmt]
    assert (p.act.fmt, p.act.packing, p.act.scales, p.act.base.dtype) == (act_fmt, "int8", None, torch.float32)
    assert (p.wgt.fmt, p.wgt.packing, p.wgt.scales.dtype) == ("int4_pg", "nibbles", torch.uint8)
    assert p.problem == Problem(64, 32, 128, 16, scale_dtype=torch.uint8, fmt="int4_pg", act_fmt=act_fmt)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))       # the same first draw as make_workload
    assert torch.equal(p.act.data, quantize(x, act_fmt).as_int8().data)
    int4 = make_workload(64, 32, 128, 16, device="cpu", seed=3)
    assert torch.equal(p.lora_up, int4.lora_up) and torch.equal(p.bias, int4.bias)   # the same draws for every format
    assert torch.equal(make_workload(64, 32, 128, 16, fmt=fmt, device="cpu", seed=3).act.data, p.act.data)


@pytest.mark.parametrize("q", [quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(0)), fmt)
                               for fmt in ("int4", "nvfp4", "int4_pg", "int8")]
                         + [quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(0)), "int4_pg").as_int8()],
                         ids=["int4", "nvfp4", "int4_pg", "int8", "int4_pg-int8-packing"])
def test_dequantize_bf16_matches_dequantize(q):
    ref = dequantize(q)
    out = dequantize_bf16(q, byte_table(q.fmt, "cpu") if q.packing == "nibbles" else None)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=0)   # two bf16 roundings: the scale, the product


def test_byte_table_of_int4_pg_is_int4s():
    assert torch.equal(byte_table("int4_pg", "cpu"), byte_table("int4", "cpu"))
    with pytest.raises(ValueError, match="fmt"):
        byte_table("int8", "cpu")          # int8 has no nibbles: dequantize_bf16 casts it


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "int4_pg", "int8"])
@pytest.mark.parametrize("method", [torch_bf16, naive_dequant])
def test_cpu_baselines_match_reference(method, fmt):
    p = make_workload(96, 80, 256, 32, fmt=fmt, device="cpu", seed=1)
    ref = w4a4_gemm_ref(*p.operands)
    assert rel_err(workloads.w4a4_gemm_dequant(*p.operands), ref) < 1e-6   # run_bench's reference, for every format
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
    assert [m.name for m in DIAGNOSTICS if m.config is None] == ["torch_fp8_gemm", "cute_fp8_gemm", "cute_int8_gemm"]
    assert all(m.fmts == ("int4",) for m in KERNELS + DIAGNOSTICS if m.kernel)          # the int4 kernels: int4 workloads only
    assert all(m.fmts is None for m in _non_kernels())                           # the others: every format


def _non_kernels():
    "The methods that are not this book's kernels: the baselines and the stock GEMMs."
    return [m for m in list(METHODS.values()) + list(DIAGNOSTICS) if not m.kernel]


def test_pg_methods_and_default_sets():
    "The int4_pg methods are KernelRefs to `find_kernel('v2', fmt='int4_pg')`; each format has its default method set."
    pg = {m.name: m for m in PG_KERNELS}
    assert PG_KERNEL == KernelRef("int4_pg", "v2", chosen=True)
    assert {n: (m.config, m.fmts, m.checked, m.kernel) for n, m in pg.items()} == {
        "w4a4_pg": (PG_KERNEL, ("int4_pg",), True, True),
        "w4a4_pg_2cta": (KernelRef("int4_pg", "v2", fields=(("cluster_n", 2),)), ("int4_pg",), True, True),
        "w4a4_pg_pure": (PG_KERNEL, ("int4_pg",), False, True),
        "w4a4_pg_smem": (KernelRef("int4_pg", "v2", "smem"), ("int4_pg",), True, True),
        "w4a4_pg_256": (KernelRef("int4_pg", "v2", fields=(("tile_m", 256), ("epi_vectors", "smem"))), ("int4_pg",), True, True),
        "w4a4_pg_224": (KernelRef("int4_pg", "v2", fields=(("tile_m", 224), ("epi_vectors", "smem"))), ("int4_pg",), True, True),
        "w4a4_pg_sk": (KernelRef("int4_pg", "v2sk"), ("int4_pg",), True, True),
        "w4a4_pg_128": (KernelRef("int4_pg", "v2", fields=(("tile_m", 128),)), ("int4_pg",), True, True),
        "w4a4_pg_64": (KernelRef("int4_pg", "v2", fields=(("tile_m", 64),)), ("int4_pg",), True, True),
        "w4a4_pg_epi1": (KernelRef("int4_pg", "v2", fields=(("epi_stages", 1),)), ("int4_pg",), True, True),
        "w4a4_pg_lora32": (KernelRef("int4_pg", "v2", fields=(("lora_chunk", 32), ("lora_stages", 2))), ("int4_pg",), True, True),
        "w4a4_pg_pure_2cta": (KernelRef("int4_pg", "v2", fields=(("cluster_n", 2),)), ("int4_pg",), False, True),
        "w4a4_pg_v1": (KernelRef("int4_pg", "v1", fields=(("tile_m", 128),)), ("int4_pg",), True, True),
        "w4a8": (PG_KERNEL, ("int8",), True, True)}
    assert default_methods() == default_methods("nvfp4") == list(METHODS)
    assert default_methods("int4_pg") == ["torch_bf16", "torch_fp8_rowwise", "torch_fp8_gemm", "cute_int8_gemm",
                                          "w4a4_pg", "w4a4_pg_2cta", "w4a4_pg_pure", "w4a4_pg_smem", "w4a4_pg_128"]
    assert default_methods("int8") == ["torch_bf16", "torch_fp8_rowwise", "torch_fp8_gemm", "cute_int8_gemm", "w4a8"]
    assert list(ALL_METHODS)[:len(METHODS)] == list(METHODS) and set(pg) < set(ALL_METHODS)
    with pytest.raises(ValueError, match="fmt"):
        default_methods("int2")


def test_kernel_ref_is_looked_up_when_resolved(monkeypatch):
    "A KernelRef names a kernel by format, kernel and mainloop; `resolve` asks the registry then, and checks the config."
    assert KernelRef("int4", "v2", fields=(("cluster_n", 2),)).resolve() == HopperV2Config(cluster_n=2)
    assert KernelRef("int4", "v1").resolve() == HopperV1Config()
    with pytest.raises(ValueError, match="no kernel computes 'nvfp4' on sm_90a"):
        KernelRef("nvfp4", "v2").resolve()
    with pytest.raises(ValueError, match="cluster_n=4"):
        KernelRef("int4", "v2", fields=(("cluster_n", 4),)).resolve()
    asked = []
    def find_kernel(kernel, fmt, arch, mainloop):
        asked.append((kernel, fmt, arch, mainloop))
        return registry.REGISTRY["sm_90a", "v2", "int4", "promote"]     # a stand-in row: any registered config class
    monkeypatch.setattr(registry, "find_kernel", find_kernel)
    m = kernel_method("k", KernelRef("int4_pg", "v2", fields=(("cluster_n", 2),)))
    assert asked == [] and m.fmts == ("int4_pg",)                    # declaring the method looked nothing up
    assert workloads.resolve_config(m.config) == HopperV2Config(cluster_n=2)
    assert asked == [("v2", "int4_pg", "sm_90a", None)]
    assert workloads.resolve_config(HopperV1Config()) == HopperV1Config()


def _pg_row_or_skip():
    try:
        return registry.find_kernel("v2", fmt="int4_pg")
    except ValueError as e:
        pytest.skip(f"the int4_pg kernel is not registered yet ({e})")


def test_pg_methods_reach_the_kernel_on_cpu(monkeypatch):
    """Once the int4_pg row exists: each int4_pg method, built on its workload, passes `gemm.gemm_launcher`'s checks
    against the kernel's requirements and gets its launch tensors; only the device checks, the compilation and the
    launch are stubbed, so this runs without a GPU."""
    spec = _pg_row_or_skip()
    compiled = []
    monkeypatch.setattr(gemm.operands, "check_devices", lambda *a, **k: None)
    monkeypatch.setattr(gemm, "compiled_kernel", lambda config, p, *a, **k: compiled.append((config, p)) or (lambda *a: None))
    for m in PG_KERNELS:
        w = make_workload(256, 512, 1024, 32, fmt=m.fmts[0], device="cpu")
        out = m.build(w)()
        config, p = compiled[-1]
        assert registry.spec_for(config).fmt == spec.fmt == "int4_pg" and out.shape == (256, 512)
        pure = "pure" in m.name
        assert (p.fmt, p.act_fmt, p.R, p.out_dtype) == ("int4_pg", m.fmts[0], 0 if pure else 32,
                                                       torch.float16 if pure else torch.bfloat16)
        assert heuristics.cluster_size(config) == (2 if "2cta" in m.name else 1)


def test_pg_pure_problem_compiles_without_a_gpu():
    "The pure int4_pg GEMM (no LoRA, no affine, fp16 out), the one compared with the stock INT8 GEMM, compiles for sm_90a."
    _pg_row_or_skip()
    pure = next(m for m in PG_KERNELS if m.name == "w4a4_pg_pure")
    w = make_workload(4352, 3072, 3840, 32, fmt="int4_pg", device="cpu")
    config = workloads.resolve_config(pure.config)
    p = gemm.operands.check_gemm_operands(w.act, w.wgt, out_dtype=torch.float16)
    rep = jit.compile_kernel(config, p)
    assert rep.instructions["wgmma (int8)"] > 0 and rep.instructions["wgmma (16-bit)"] == 0   # no LoRA product
    assert rep.instructions["local memory"] == 0


def test_kernel_unavailable_of_a_kernel_ref(monkeypatch):
    "Before its row is registered, a KernelRef's kernel is unavailable, and the note says why."
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    note = workloads.kernel_unavailable(KernelRef("nvfp4", "v2"))
    assert note.startswith("ValueError: fmt: no kernel computes 'nvfp4' on sm_90a")
    assert workloads.kernel_unavailable(KernelRef("int4", "v2", fields=(("cluster_n", 2),))) is None
    assert workloads.kernel_unavailable(KernelRef("int4", "v2", fields=(("no_such_field", 2),))).startswith("TypeError")


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


def test_pg_methods_launch_their_looked_up_config(monkeypatch):
    "The int4_pg methods resolve their KernelRef when built and hand the launcher the workload's int4_pg operands."
    seen = []
    def fake_launcher(*ops, out_dtype, config):
        seen.append(dict(fmts=(ops[0].fmt, ops[0].packing, ops[1].fmt, ops[1].packing), n_ops=len(ops),
                         out_dtype=out_dtype, config=config))
        return (lambda: None), torch.zeros(ops[0].rows, ops[1].rows, dtype=out_dtype)
    row = registry.REGISTRY["sm_90a", "v2", "int4", "promote"]
    monkeypatch.setattr(registry, "find_kernel", lambda kernel, fmt, arch, mainloop: row)   # stands in for the int4_pg row
    monkeypatch.setattr(gemm, "gemm_launcher", fake_launcher)
    pg = {m.name: m for m in PG_KERNELS}
    w = make_workload(64, 128, 128, 16, fmt="int4_pg", device="cpu")
    for name in ("w4a4_pg", "w4a4_pg_2cta", "w4a4_pg_pure"):
        assert pg[name].build(w)().shape == (64, 128)
    a8 = make_workload(64, 128, 128, 16, fmt="int8", device="cpu")
    assert pg["w4a8"].build(a8)().shape == (64, 128)
    pg_ops, w4a8_ops = ("int4_pg", "int8", "int4_pg", "nibbles"), ("int8", "int8", "int4_pg", "nibbles")
    assert seen == [dict(fmts=pg_ops, n_ops=6, out_dtype=torch.bfloat16, config=HopperV2Config()),
                    dict(fmts=pg_ops, n_ops=6, out_dtype=torch.bfloat16, config=HopperV2Config(cluster_n=2)),
                    dict(fmts=pg_ops, n_ops=2, out_dtype=torch.float16, config=HopperV2Config()),   # pure: fp16, no LoRA
                    dict(fmts=w4a8_ops, n_ops=6, out_dtype=torch.bfloat16, config=HopperV2Config())]


def test_budget_of_a_kernel_method():
    "The stages a kernel method runs with are the solver's for its config at the workload's problem."
    from w4a4_book import smem
    p = make_workload(64, 128, 3840, 128, device="cpu").problem
    stages = {m.name: smem.solve(m.config, p).stages["main"] for m in KERNELS}
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
    """report -> workloads -> timing, never back; the layer benchmark uses the harness and the report, and nothing in
    them imports the layer's benchmark."""
    pkg = Path(workloads.__file__).parent
    def deps(name):
        tree = ast.parse((pkg / f"{name}.py").read_text())
        return {n.module.split(".")[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1}
    assert deps("timing") == set()
    assert deps("workloads") == {"timing"}
    assert deps("report") == {"timing", "workloads"}
    assert deps("layer") == {"timing", "workloads", "report"}     # the README's records: printed first without a GPU
    assert deps("block") == {"layer", "timing", "workloads", "report"}


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
    small = report.compact_png(fig)                         # the notebooks' stored form: a palette PNG, shown at size
    from PIL import Image as Pil
    png = Pil.open(io.BytesIO(small.data))
    assert png.mode == "P" and (small.width, small.height) == (png.size[0] // 2, png.size[1] // 2)
    assert report.compact_png(fig).data == small.data       # deterministic: a refresh stores the same bytes


def _parser():
    p = argparse.ArgumentParser()
    report.add_arguments(p)
    return p


def test_cli_command_round_trip():
    "The stored command spells out every option, the format's default methods included, and parses back to the same run."
    for fmt in ("int4", "int4_pg", "int8"):
        args = _parser().parse_args(["--shapes", "m4352", "--ranks", "32", "--iters", "30", "--fmt", fmt])
        command = report._command(args)
        assert command.startswith(f"w4a4-book bench --shapes m4352 --methods {' '.join(default_methods(fmt))} --fmt {fmt} ")
        back = _parser().parse_args(command.split()[2:])
        assert back.methods == default_methods(fmt) and vars(back) | {"methods": None} == vars(args)
        assert report._command(back) == command
    with pytest.raises(SystemExit):
        _parser().parse_args(["--methods", "no_such_method"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--fmt", "int2"])


def test_cli_record_names_never_collide_across_formats():
    tag = lambda *argv: report._tag(_parser().parse_args(list(argv)))
    assert tag("--shapes", "all", "--fmt", "int4") == "all"                  # int4: the names of the existing records
    assert tag("--shapes", "all") == "int4_pg_all"                           # the default format, int4_pg
    assert tag("--shapes", "m4352", "--fmt", "int4_pg") == "int4_pg_m4352"
    assert tag("--fmt", "int8") == "int8_all"
    assert tag("--fmt", "int4_pg", "--tag", "x") == "x"


@needs_no_cuda
def test_cli_refuses_cpu(capsys):
    "Without a GPU `bench` says so in one line on stderr and exits 1: no traceback, nothing saved."
    assert report.bench_cli(["--shapes", "8192", "--iters", "20"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU" in err[0]


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


def test_run_bench_int4_pg_rows(fake_h200):
    "An int4_pg run: the baselines on int4_pg workloads, the int4 kernels and W4A8 skipped with a note, rows carrying fmt."
    asked = []
    fake_h200.setattr(workloads, "kernel_unavailable", lambda config=None: asked.append(config) or "not here")
    methods = ["torch_bf16", "naive_dequant", "w4a4_v2", "w4a4_pg", "w4a4_pg_pure", "w4a8"]
    rows = workloads.run_bench([(64, 128, 128, 16)], methods, fmt="int4_pg", iters=20, quiet=True)
    assert [r["method"] for r in rows] == methods and {r["fmt"] for r in rows} == {"int4_pg"}
    by = {r["method"]: r for r in rows}
    for name in ("torch_bf16", "naive_dequant"):
        assert by[name]["rel_err"] < 1e-2 and by[name]["out_dtype"] == "bfloat16" and by[name]["note"] is None
    assert by["w4a4_v2"]["note"] == "skipped: w4a4_v2 runs on int4 workloads, this run is int4_pg"
    assert by["w4a8"]["note"] == "skipped: w4a8 runs on int8 workloads, this run is int4_pg"
    assert by["w4a4_pg"]["note"] == by["w4a4_pg_pure"]["note"] == "not here"
    assert asked == [PG_KERNEL, PG_KERNEL]          # only the kernels of this format are asked about
    w4a8 = workloads.run_bench([(64, 128, 128, 16)], ["torch_bf16", "w4a8"], fmt="int8", iters=20, quiet=True)
    assert [(r["fmt"], r["note"]) for r in w4a8] == [("int8", None), ("int8", "not here")] and w4a8[0]["rel_err"] < 1e-2


def test_run_bench_default_methods_follow_the_format(fake_h200):
    fake_h200.setattr(workloads, "DEFAULT_METHODS", {**workloads.DEFAULT_METHODS, "int4_pg": ("torch_bf16", "w4a4_pg")})
    rows = workloads.run_bench([(64, 128, 128, 16)], fmt="int4_pg", iters=20, quiet=True)
    assert [r["method"] for r in rows] == ["torch_bf16", "w4a4_pg"]
    with pytest.raises(ValueError, match="fmt"):
        workloads.run_bench([(64, 128, 128, 16)], fmt="int2", iters=20, quiet=True)


def test_stock_gemm_without_its_path_leaves_a_note(fake_h200):
    fake_h200.delenv(workloads.STOCK_GEMM_ENV, raising=False)
    rows = workloads.run_bench([(64, 128, 128, 16)], ["cute_int8_gemm", "cute_fp8_gemm"], fmt="int4_pg", iters=20, quiet=True)
    assert all(r["tflops"] is None and r["note"].startswith("NotImplementedError: set W4A4_STOCK_GEMM") for r in rows)
    with pytest.raises(ValueError, match="which"):
        workloads.stock_gemm_kernel("int4")


def _stock_path():
    "The stock example: `$W4A4_STOCK_GEMM`, or the copy this checkout keeps under .whl/stock/ (not in git)."
    path = os.environ.get(workloads.STOCK_GEMM_ENV) or str(Path(__file__).resolve().parents[1] / ".whl/stock/dense_gemm_persistent.py")
    if not Path(path).is_file():
        pytest.skip(f"no stock dense_gemm_persistent.py: set {workloads.STOCK_GEMM_ENV}")
    return path


@pytest.mark.parametrize("which,mma", [("int8", "m64n256k32.satfinite.s32.s8.s8"), ("fp8", "m64n256k32.f32.e4m3.e4m3")])
def test_stock_gemm_compiles_for_sm90a_without_a_gpu(which, mma):
    "The bench's stock GEMM kernel object, compiled on fake tensors: 128x256 tiles (two 64x256 warpgroups), 2x1 cluster."
    path = _stock_path()
    kernel, (ab, acc, c) = workloads.stock_gemm_kernel(which, path)
    import cutlass
    assert (kernel.tile_shape_mnk[:2], kernel.cluster_shape_mn, kernel.acc_dtype) == ((128, 256), (2, 1), acc)
    if which == "int8":   # the combination the example itself accepts: Int8 A/B, Int32 accumulator, Float16 C, K-major
        assert (ab, acc, c) == (cutlass.Int8, cutlass.Int32, cutlass.Float16)
        assert type(kernel).is_valid_dtypes(ab, ab, acc, c, "k", "k")
        assert type(kernel).is_valid_tensor_alignment(4352, 3072, 3840, 1, ab, c, "k", "k", "n")
    ptx = workloads.stock_gemm_ptx(which, 4352, 3072, 3840, path=path)
    assert sorted(set(re.findall(r"wgmma\.mma_async\S*", ptx))) == [f"wgmma.mma_async.sync.aligned.{mma}"]
    assert "multicast::cluster" in ptx          # the B tile is shared by the two CTAs of the 2x1 cluster
    if which == "int8":
        assert "cvt.rn.f16.s32" in ptx          # the int32 accumulator goes straight to fp16


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
    common = ["--shapes", "m256", "--methods", "torch_bf16", "w4a4_v1", "--fmt", "int4", "--iters", "20"]
    record = tmp_path / "bench_h200_test.json"
    assert report.bench_cli(common + ["--out", str(record)]) == 0
    prov, rows = load_record(record)
    assert prov["command"] == "w4a4-book bench " + " ".join(common[:-2] + ["--iters", "20", "--warmup", "10"])
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


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_pg", "int8"])
def test_pg_run_on_gpu(fmt):
    "One small int4_pg (or W4A8) problem, the format's default methods: right baselines, and every row timed or saying why not."
    rows = workloads.run_bench([(256, 3072, 3840, 32)], fmt=fmt, iters=20, warmup=2, quiet=True)
    assert [r["method"] for r in rows] == default_methods(fmt) and {r["fmt"] for r in rows} == {fmt}
    by = {r["method"]: r for r in rows}
    for r in rows:
        if r["tflops"] is None:   # a kernel not registered yet or not runnable here; the stock GEMM without its path
            assert r["note"] and (r["kernel"] or r["method"] == "cute_int8_gemm"), r
            continue
        assert r["tflops"] == pytest.approx(tflops(256, 3072, 3840, r["median_ms"]))
        if r["rel_err"] is not None:
            assert r["rel_err"] < (1e-1 if r["method"] == "torch_fp8_rowwise" else 1e-2), r
    assert by["torch_bf16"]["tflops"] is not None and by["torch_fp8_rowwise"]["tflops"] is not None
    for name in ("w4a4_pg_pure", "cute_int8_gemm"):   # the like-for-like pair: both write fp16
        if name in by and by[name]["tflops"] is not None:
            assert by[name]["out_dtype"] == "float16", by[name]
    if fmt == "int4_pg" and all(by[m]["tflops"] for m in ("w4a4_pg", "cute_int8_gemm", "w4a4_pg_pure")):
        table, verdicts = report.pg_targets(rows)
        assert len(verdicts) == 5 and "256×3072×3840" in table


@pytest.mark.gpu
def test_stock_int8_gemm_on_gpu():
    "The stock INT8 GEMM computes the int32 sum of its int8 operands, rounded once to fp16."
    path = _stock_path()
    fn = workloads.stock_int8_gemm(make_workload(256, 512, 1024, 32, fmt="int4_pg"), path=path)
    out = fn()
    torch.cuda.synchronize()
    a, b = fn.operands
    assert out.dtype == torch.float16 and out.shape == (256, 512, 1)
    ref = torch.einsum("mkl,nkl->mnl", a.double(), b.double())
    assert torch.equal(out, ref.to(torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4", "int4_pg", "int8"])
def test_activation_kernel_captures(fmt):
    "`quantize_lora_down` captures in a CUDA graph (nothing in it waits for the host), and a replay rewrites its outputs exactly."
    x, smooth, ldt = bench_layer._activation_inputs(256, 512, 32)
    eager_act, eager_lora = act_quant.quantize_lora_down(x, smooth, ldt, fmt=fmt)
    got = {}
    def call():
        got["out"] = act_quant.quantize_lora_down(x, smooth, ldt, fmt=fmt)
    replay = timing.cuda_graph(call)       # raises RuntimeError if the call synchronises with the host
    act, lora = got["out"]
    for t in (act.data, lora, act.scales, act.base):
        if t is not None:
            t.zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(act.data, eager_act.data) and torch.equal(lora, eager_lora)
    for name in ("scales", "base"):
        if getattr(eager_act, name) is not None:
            assert torch.equal(getattr(act, name), getattr(eager_act, name)), name


@pytest.mark.gpu
def test_activation_bench_times_graphs_and_eager():
    rows = bench_layer.run_activation_bench([(256, 512)], R=16, iters=20, warmup=2, quiet=True)
    assert [r["fmt"] for r in rows] == list(bench_layer.ACTIVATION_FORMATS)
    for r in rows:
        assert r["timing"] == "graph" and r["median_ms"] > 0 and r["eager_median_ms"] > 0
        assert r["bandwidth"] == pytest.approx(r["bytes"] / (r["median_ms"] * 1e-3))
    assert len(bench_layer.activation_table(rows).splitlines()) == 2 + len(rows)


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


def _pg_run(tf_by_method, problems=None, fmt="int4_pg"):
    "Made-up rows of one int4_pg run (not measurements): every method at the same TFLOP/s on every problem, unless a dict per problem."
    problems = problems or [(4352, n, k, 32) for k, n in workloads.LAYER_KN]
    return [dict(method=m, kernel=m.startswith("w4a"), fmt=fmt, M=M, N=N, K=K, R=R, tflops=t, mfu=None if t is None else t / 1979.0)
            for (M, N, K, R) in problems for m, t in (tf_by_method(M, N, K, R) if callable(tf_by_method) else tf_by_method).items()]


PG_TF = {"torch_bf16": 500.0, "torch_fp8_rowwise": 800.0, "torch_fp8_gemm": 1300.0, "cute_int8_gemm": 1250.0,
         "w4a4_pg": 1050.0, "w4a4_pg_2cta": 1060.0, "w4a4_pg_pure": 1150.0}


def test_pg_targets_all_pass():
    table, verdicts = report.pg_targets(_pg_run(PG_TF))
    assert [v["passed"] for v in verdicts] == [True] * 5 and all(v["missing"] == [] for v in verdicts)
    assert [v["value"] for v in verdicts] == pytest.approx([1050 / 1250, 1050 / 800, 1150 / 1250, 1050 / 800, 1050 / 500])
    assert [v["where"] for v in verdicts] == ["each"] * 3 + ["geomean"] * 2
    assert verdicts[0]["target"] == "w4a4_pg / cute_int8_gemm ≥ 0.8 on every problem"
    assert verdicts[4]["target"] == "w4a4_pg / torch_bf16 ≥ 2.0 (geometric mean over M = 4352, R = 32)"
    lines = table.splitlines()
    assert lines[0] == ("| M×N×K | R | w4a4_pg TFLOP/s | w4a4_pg MFU | w4a4_pg / cute_int8_gemm | w4a4_pg / torch_fp8_rowwise "
                        "| w4a4_pg_pure / cute_int8_gemm | w4a4_pg / torch_bf16 |")
    assert lines[2] == "| 4352×3072×3840 | 32 | 1050 | 53.1% | 0.84× ✓ | 1.31× ✓ | 0.92× ✓ | 2.10× |"
    assert lines[-1] == "| geomean, M = 4352 | 32 |  |  |  | 1.31× ✓ |  | 2.10× ✓ |"
    assert report.target_lines(verdicts)[3] == ("PASS w4a4_pg / torch_fp8_rowwise ≥ 1.25 (geometric mean over M = 4352, "
                                                "R = 32): geomean 1.31×")


def test_pg_targets_geomean_and_failures():
    "The geometric mean is over the M = 4352, R = 32 problems only; one slow problem fails its per-problem target."
    fp8 = {3840: 700.0, 15360: 900.0, 10240: 1000.0}
    def tf(M, N, K, R):
        return {**PG_TF, "torch_fp8_rowwise": 2000.0 if M == 256 or R == 128 else fp8[K] if N != 15360 else 1100.0}
    problems = [(4352, n, k, r) for k, n in workloads.LAYER_KN for r in (32, 128)] + [(256, 3072, 3840, 32)]
    _, verdicts = report.pg_targets(_pg_run(tf, problems))
    big = [700.0, 1100.0, 900.0, 1000.0]           # the fp8 path at M = 4352, R = 32, in LAYER_KN order
    assert verdicts[3]["value"] == pytest.approx(report.geomean([1050.0 / t for t in big]))
    assert verdicts[1] == dict(target="w4a4_pg / torch_fp8_rowwise ≥ 1.0 on every problem", threshold=1.0, where="each",
                               value=pytest.approx(1050 / 2000), passed=False, missing=[])
    assert [v["passed"] for v in verdicts] == [True, False, True, False, True]
    assert report.geomean([2.0, 8.0]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="positive"):
        report.geomean([])


def test_pg_targets_gaps_and_roles():
    "A problem the kernel did not run on is a failed target, named; W4A8 runs drop the pure target; one format per call."
    rows = [{**r, "tflops": None, "mfu": None} if r["method"] == "w4a4_pg" and r["N"] == 15360 else r for r in _pg_run(PG_TF)]
    table, verdicts = report.pg_targets(rows)
    assert [v["passed"] for v in verdicts] == [False, False, True, False, False]
    assert verdicts[0]["missing"] == ["4352×15360×3840 R=32"] and verdicts[3]["missing"] == ["4352×15360×3840 R=32"]
    assert verdicts[0]["value"] == pytest.approx(1050 / 1250)          # the worst of the problems it ran on
    assert "| 4352×15360×3840 | 32 | — | — | — | — | 0.92× ✓ | — |" in table
    assert report.target_lines(verdicts)[0] == ("FAIL w4a4_pg / cute_int8_gemm ≥ 0.8 on every problem: worst 0.84×; "
                                                "not measured on 4352×15360×3840 R=32")
    w4a8 = _pg_run({"torch_bf16": 500.0, "torch_fp8_rowwise": 800.0, "cute_int8_gemm": 1250.0, "w4a8": 1050.0}, fmt="int8")
    _, v8 = report.pg_targets(w4a8, kernel="w4a8", pure=None)
    assert [v["target"].split(" ≥")[0] for v in v8] == ["w4a8 / cute_int8_gemm", "w4a8 / torch_fp8_rowwise",
                                                        "w4a8 / torch_fp8_rowwise", "w4a8 / torch_bf16"]
    _, none = report.pg_targets(_pg_run(PG_TF, [(256, 3072, 3840, 32)]))
    assert none[3]["passed"] is False and none[3]["value"] is None     # no M = 4352, R = 32 problem: nothing to average
    assert report.target_lines(none)[3].endswith("(geometric mean over M = 4352, R = 32): no ratio")
    with pytest.raises(ValueError, match="one format"):
        report.pg_targets(_pg_run(PG_TF) + _pg_run(PG_TF, fmt="int4"))
    with pytest.raises(ValueError, match="over='cute_int8_gemm'"):
        report.pg_targets([r for r in _pg_run(PG_TF) if r["method"] != "cute_int8_gemm"])


def test_cli_int4_pg_run_prints_its_targets(fake_h200, tmp_path, capsys):
    "`bench --fmt int4_pg`: int4_pg workloads, the targets printed after the table, the record named by format."
    fake_h200.setattr(report, "bench_problems", lambda which, ranks: [(64, 128, 128, 16)])
    fake_h200.setattr(workloads, "kernel_unavailable", lambda config=None: None)
    for name in ("torch_fp8_rowwise", "cute_int8_gemm", "w4a4_pg"):      # stand-ins that run on the CPU
        fake_h200.setitem(workloads.METHODS, name, Method(name, torch_bf16, kernel=name == "w4a4_pg"))
    argv = ["--shapes", "m256", "--fmt", "int4_pg", "--methods", "torch_bf16", "torch_fp8_rowwise", "cute_int8_gemm",
            "w4a4_pg", "--iters", "20", "--out", str(tmp_path / "bench_h200_pg.json")]
    assert report.bench_cli(argv) == 0
    out = capsys.readouterr().out
    assert "PASS w4a4_pg / cute_int8_gemm ≥ 0.8 on every problem: worst 1.00×" in out
    assert "FAIL w4a4_pg / torch_fp8_rowwise ≥ 1.25 (geometric mean over M = 4352, R = 32): no ratio" in out
    assert "w4a4_pg_pure" not in out                              # not timed: its target is dropped
    prov, rows = load_record(tmp_path / "bench_h200_pg.json")
    assert {r["fmt"] for r in rows} == {"int4_pg"} and "--fmt int4_pg" in prov["command"]
    assert report.bench_path("NVIDIA H200", report._tag(_parser().parse_args(["--fmt", "int4_pg"]))).name == "bench_h200_int4_pg_all.json"


def test_record_line():
    "The re-measure command, with the format a command that names none ran with (int4, then the default)."
    prov = provenance("w4a4-book bench --shapes 8192", [[8192, 8192, 8192, 32]])
    line = record_line("bench_x.json", prov)
    assert line.startswith("`bench_x.json`: ") and line.endswith("Re-measure: `w4a4-book bench --fmt int4 --shapes 8192`")
    stock = record_line("bench_y.json", {**prov, "command": "w4a4-book bench --methods cute_int8_gemm --fmt int4_pg"})
    assert stock.endswith("--fmt int4_pg` (`cute_int8_gemm`: " + report.STOCK_SETUP + ")")
    with pytest.raises(ValueError, match="command"):
        record_line("bench_x.json", {**prov, "command": ""})


def test_lora_line():
    rows = [dict(R=r, accounting=a, main_stages=s, fixed_over_bug=x)
            for r, a, s, x in [(128, "pair", 1, 1.2), (128, "per_cta", 3, 1.2), (128, "pair", 2, 1.05),
                               (128, "per_cta", 3, 1.05)]]
    assert lora_line(rows) == "v2 int4 2-CTA: R = 128: main stages 1–2 with the bug (`pair`) against 3 fixed (`per_cta`), fixed/bug 1.05–1.20×."
    two = [dict(r, config=c) for c in ("A", "B") for r in rows[:2]] + [dict(config="B", R=256, accounting="pair", main_stages=0, fixed_over_bug=None),
                                                                    dict(config="B", R=256, accounting="per_cta", main_stages=3, fixed_over_bug=None)]
    assert lora_line(two) == ("A: R = 128: main stages 1 with the bug (`pair`) against 3 fixed (`per_cta`), fixed/bug 1.20×. "
                              "B: R = 256: main stages 0 with the bug (`pair`) against 3 fixed (`per_cta`), the bug leaves no stage, "
                              "nothing builds; R = 128: main stages 1 with the bug (`pair`) against 3 fixed (`per_cta`), fixed/bug 1.20×.")
    with pytest.raises(ValueError, match="both accountings"):
        lora_line(rows[::2])
    with pytest.raises(ValueError, match="non-empty"):
        lora_line([])


def test_readme_results_from_another_folder(tmp_path):
    extra = (WAVES_RECORD, LORA_RECORD, ACTIVATION_README_RECORD, MOVES_RECORD)
    for name in README_RECORDS + PG_README_RECORDS + LAYER_README_RECORDS + extra:
        prov, rows = load_record(data_dir()/name)
        if name == README_RECORDS[0]:
            rows = [{**r, "tflops": 2 * r["tflops"]} if r["method"] == "w4a4_v2" and r["M"] == 8192 else r for r in rows]
        save_record(tmp_path/name, prov, rows)
    assert readme_results(tmp_path) != readme_results()
    assert readme_results(tmp_path).count("Re-measure: `") == len(README_RECORDS + PG_README_RECORDS + LAYER_README_RECORDS + extra)


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
    # in a process of its own: a capture that fails leaves this process's CUDA generator in capture mode, and every
    # later random draw on the GPU in it raises ("Offset increment outside graph capture")
    # (torch names the error AcceleratorError, a RuntimeError)
    code = ("import torch; from w4a4_book.bench import timing; x = torch.ones(8, device='cuda')\n"
            "try: timing.cuda_graph(lambda: x.sum().item())\n"
            "except RuntimeError as e: print('refused:', type(e).__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("refused:"), r.stdout + r.stderr[-2000:]


def test_bench_layer_grid_needs_activation():
    "`--grid` sweeps the activation kernel's launch grid; on the layer benchmark it is refused, naming the option."
    from w4a4_book.bench import layer
    p = argparse.ArgumentParser(); layer.add_arguments(p)
    with pytest.raises(ValueError, match="--grid"):
        layer.run(p.parse_args(["--grid"]))
    assert layer.ACTIVATION_GRID[0] == (2, 2) and (heuristics.ACT_CTAS_PER_SM, heuristics.ACT_STAGES) in layer.ACTIVATION_GRID


def test_depth_model_and_chase_buffer():
    "The depth model's three regimes, and the chase buffer's single cycle through every cache line."
    from w4a4_book.bench import latency
    assert latency.depth_model(1.0, 3.0, 1) == 4.0 and latency.depth_model(1.0, 3.0, 4) == 1.0
    assert latency.stages_needed(1.0, 3.0) == 4 and latency.stages_needed(1.0, 0.0) == 1
    with pytest.raises(ValueError, match="stages=0"):
        latency.depth_model(1.0, 1.0, 0)
    b = latency.chase_buffer(1 << 14, device="cpu")
    heads = b[::latency.LINE]
    assert sorted(heads.tolist()) == list(range(0, b.numel(), latency.LINE))   # every line is some line's successor


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dram_latency_on_gpu():
    from w4a4_book.bench import latency
    dram, l2 = latency.dram_latency(hops=20_000), latency.dram_latency(nbytes=4 << 20, hops=20_000)
    assert 0 < l2 < dram < 5e-6


def test_recorded_activation_runs_tell_the_grid_sweep_apart():
    "Without a GPU, `--activation` shows the defaults' record and `--activation --grid` the sweep's, never both."
    from w4a4_book.bench import layer
    p = argparse.ArgumentParser(); layer.add_arguments(p)
    plain = layer.recorded_runs(p.parse_args(["--activation", "--shapes", "m4352"]))
    grid = layer.recorded_runs(p.parse_args(["--activation", "--grid", "--shapes", "m4352"]))
    assert plain and grid
    assert all("--grid" not in prov["command"] for prov, _ in plain) and all("--grid" in prov["command"] for prov, _ in grid)


def test_layer_paths_order_and_the_compiled_path_skipped_by_reason(monkeypatch):
    "torch_fp8_compiled follows torch_fp8 and is captured like it; where torch.compile cannot make GPU kernels it alone is skipped, with the reason."
    paths = bench_layer.LAYER_PATHS
    assert paths.index("torch_fp8_compiled") == paths.index("torch_fp8") + 1 and paths.index("w4a4_pg_w4a8") == paths.index("w4a4_pg") + 1
    assert "torch_fp8_compiled" not in bench_layer.EAGER_ONLY
    monkeypatch.setattr(bench_layer, "compile_unavailable", lambda: "no triton here")
    assert bench_layer.unavailable_paths() == {"torch_fp8_compiled": "torch.compile is unavailable: no triton here"}
    monkeypatch.setattr(bench_layer, "compile_unavailable", lambda: None)
    assert bench_layer.unavailable_paths() == {}


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="checks the reason given without triton")
def test_compile_unavailable_names_triton():
    assert "triton" in bench_layer.compile_unavailable()


def test_fp8_rowwise_act_is_the_torch_fp8_quantization():
    "One fp32 scale per row, amax over 448; codes times scales give back x to E4M3's precision (3 mantissa bits)."
    x = torch.randn(8, 256).bfloat16()
    q, s = bench_layer.fp8_rowwise_act(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (8, 1)
    torch.testing.assert_close(s, x.float().abs().amax(1, keepdim=True) / 448)
    assert ((q.float() * s - x.float()).abs() <= x.float().abs() / 16 + s * 2 ** -9).all()   # half a step, normal or subnormal


def test_layer_table_renders_every_recorded_layer_run():
    "Records older than a path still render, `—` in its place; the fastest column is `fastest_paths`."
    for path in list_records("layer"):
        prov, rows = load_record(path)
        if prov["kind"] != "layer":          # an experiment's record of another kind, read by its own section
            continue
        lines = bench_layer.layer_table(rows).splitlines()
        head = lines[0].strip("| ").split(" | ")
        cells = [dict(zip(head, ln.strip("| ").split(" | "))) for ln in lines[2:]]
        assert len(cells) == len({(r["M"], r["K"], r["N"]) for r in rows})
        fastest = bench_layer.fastest_paths(rows)
        assert [c["fastest"] for c in cells] == list(fastest.values())
        assert all(c["w4a4 / torch_fp8_compiled"] == "—" for c in cells if "torch_fp8_compiled ms" not in c)
