"""The Hopper kernels: argument checks and CPU compiles always; correctness against the fp32 reference on an sm_90 GPU."""
import re
import pytest, torch
from w4a4_book.formats import quantize
from w4a4_book.reference import w4a4_gemm_ref
from w4a4_book import operands, jit, registry, gemm
from w4a4_book.operands import Problem
from w4a4_book.configs import HopperV1Config, HopperV2Config

CONFIGS = {"v1": HopperV1Config, "v2": HopperV2Config}

def _cpu_problem(M=64, N=256, K=256, R=32):
    a, w = quantize(torch.randn(M, K), "int4"), quantize(torch.randn(N, K), "int4")
    return a, w, torch.randn(M, R, dtype=torch.bfloat16), torch.randn(N, R, dtype=torch.bfloat16)

@pytest.mark.parametrize("bad, arg", [
    (dict(wgt=lambda p: quantize(torch.randn(256, 192), "int4")), "act"),      # "act has K=256 but wgt has K=192"
    (dict(act=lambda p: quantize(torch.randn(64, 256), "nvfp4")), "act"),
    (dict(act=lambda p: quantize(torch.randn(64, 192), "int4"), wgt=lambda p: quantize(torch.randn(256, 192), "int4")), "act"),
    (dict(lora_act=lambda p: p[2][:, :24].contiguous(), lora_up=lambda p: p[3][:, :24].contiguous()), "lora_act"),
    (dict(lora_up=lambda p: None), "lora_act"),                               # "lora_act and lora_up must be given together"
    (dict(lora_up=lambda p: p[3].half()), "lora_up"),
    (dict(lora_act=lambda p: p[2].t().contiguous().t()), "lora_act"),
    (dict(bias=lambda p: torch.zeros(128)), "bias"),
    (dict(wcscales=lambda p: torch.ones(256, dtype=torch.int32)), "wcscales"),
    (dict(out_dtype=lambda p: torch.float32), "out_dtype"),
    (dict(cluster_n=lambda p: 3), "cluster_n"),
    (dict(act=lambda p: "not a tensor"), "act"),
])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_bad_input_names_argument(bad, arg, version):
    p = _cpu_problem()
    kw = dict(act=p[0], wgt=p[1], lora_act=p[2], lora_up=p[3], cluster_n=1)
    kw.update({k: f(p) for k, f in bad.items()})
    cfg = CONFIGS[version]()
    req = registry.spec_for(cfg).kernel_class().requirements(cfg)
    with pytest.raises((TypeError, ValueError)) as e:
        operands.check_gemm_operands(**kw, req=req)
    assert re.match(rf"{arg}\b", str(e.value)), str(e.value)      # every error names its argument first

@pytest.mark.parametrize("config", [HopperV1Config(), HopperV2Config(cluster_n=2)])
def test_cpu_tensors_rejected_before_launch(config):
    a, w, la, lu = _cpu_problem()
    with pytest.raises(ValueError, match="^act: must be on a CUDA device"):
        gemm.gemm_w4a4(a, w, la, lu, config=config)

@pytest.mark.parametrize("version, R, cluster_n, accounting", [
    ("v1", 32, 1, "per_cta"), ("v1", 0, 1, "per_cta"), ("v1", 128, 2, "per_cta"), ("v1", 128, 2, "pair"),
    ("v2", 32, 1, "per_cta"), ("v2", 0, 1, "per_cta"), ("v2", 128, 2, "per_cta"), ("v2", 128, 2, "pair")])
def test_compiled_smem_equals_solver(version, R, cluster_n, accounting):
    rep = jit.compile_kernel(CONFIGS[version](cluster_n=cluster_n, lora_accounting=accounting), Problem(4352, 3072, 3840, R))
    assert rep.smem_bytes == rep.budget.allocated
    if accounting == "per_cta": assert rep.budget.total == rep.budget.allocated
    ins = rep.instructions
    assert ins["wgmma (int8)"] > 0 and ins["TMA load"] > 0 and ins["TMA store"] > 0
    assert ins["wgmma (16-bit)"] == (R // 16 if R else 0)
    assert ins["local memory"] == 0

# ---------------------------------------------------------------- GPU
def rtol_for(dtype):
    """Elementwise tolerance: the kernel's only rounding that the fp32 reference lacks is the final cast,
    at most half an ulp (2^-8 relative for bf16's 8-bit significand, 2^-11 for fp16). Twice that leaves room
    for fp32 summation-order differences; an absolute floor 2^-16·max|ref| covers outputs near zero."""
    return 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10

def make_case(M, N, K, R, out_dtype=torch.bfloat16, affine=True, scale_dtype=torch.float16, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=g)
    w = torch.randn(N, K, device=device, generator=g)
    a, wq = quantize(x, "int4", scale_dtype=scale_dtype), quantize(w, "int4", scale_dtype=scale_dtype)
    la = lu = wcs = bias = None
    if R:
        la = torch.randn(M, R, device=device, generator=g).to(out_dtype)
        lu = (0.1 * torch.randn(N, R, device=device, generator=g)).to(out_dtype)
    if affine:
        wcs = (1 + 0.1 * torch.randn(N, device=device, generator=g)).to(out_dtype)
        bias = torch.randn(N, device=device, generator=g).to(out_dtype)
    return a, wq, la, lu, wcs, bias

def check_against_ref(out, case, out_dtype):
    ref = w4a4_gemm_ref(*case)
    assert not torch.isnan(out).any(), "unwritten or NaN outputs"
    err = (out.float() - ref).abs()
    bound = rtol_for(out_dtype) * ref.abs() + 2.0 ** -16 * ref.abs().max()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max err/bound {worst:.3f}, rel {float((out.float()-ref).norm()/ref.norm()):.2e}"

GRID = [  # M (tails included), N, K, R, out dtype, affine, cluster_n
    (128, 128, 128, 16, torch.bfloat16, True, 1),
    (300, 512, 1024, 128, torch.bfloat16, True, 1),
    (777, 3840, 1536, 64, torch.float16, True, 1),
    (1000, 1024, 3840, 32, torch.bfloat16, False, 1),
    (4352, 3072, 3840, 32, torch.bfloat16, True, 1),
    (257, 2048, 640, 0, torch.float16, False, 1),
    (513, 3072, 2048, 128, torch.bfloat16, True, 2),
    (64, 256, 256, 16, torch.float16, True, 2),
]

@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("M, N, K, R, out_dtype, affine, cluster_n", GRID)
def test_matches_reference(version, M, N, K, R, out_dtype, affine, cluster_n):
    case = make_case(M, N, K, R, out_dtype, affine, seed=M + N + K + R)
    out = torch.full((M, N), float("nan"), dtype=out_dtype, device="cuda")
    gemm.gemm_w4a4(*case, out_dtype=out_dtype, config=CONFIGS[version](cluster_n=cluster_n), out=out)
    torch.cuda.synchronize()
    check_against_ref(out, case, out_dtype)

@pytest.mark.gpu
def test_bfloat16_scales():
    case = make_case(256, 256, 512, 32, scale_dtype=torch.bfloat16)
    out = gemm.gemm_w4a4(*case)
    torch.cuda.synchronize()
    check_against_ref(out, case, torch.bfloat16)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_no_register_spills_where_ptxas_exists(version):
    """PTX shows no local memory; only ptxas sees spills. v1 must not spill. v2's 40-register decode branch spills
    20 bytes at R=32 (see the gotchas chapter); its MMA branch spilling would cost about a kilobyte per thread."""
    rep = jit.compile_kernel(CONFIGS[version](cluster_n=2), Problem(4352, 3072, 3840, 128))
    res = rep.ptxas()
    if res is None:
        pytest.skip("no ptxas on this machine")
    assert res["spill_stores"] <= (0 if version == "v1" else 64), res


@pytest.mark.gpu
def test_v2_i2f_promotion_matches_reference():
    "v1's promotion, kept in v2 as the measured alternative, stays correct."
    case = make_case(300, 512, 1024, 32, seed=7)
    out = gemm.gemm_w4a4(*case, config=HopperV2Config(promotion="i2f"))
    torch.cuda.synchronize()
    check_against_ref(out, case, torch.bfloat16)


def test_v2_promotion_has_no_conversion():
    "v2's default promotion reads MAGIC + p straight from the wgmma accumulator: no I2F, two FMAs per element."
    p = Problem(4352, 3072, 3840, 32)
    biased, i2f = jit.compile_kernel(HopperV2Config(), p), jit.compile_kernel(HopperV2Config(promotion="i2f"), p)
    assert biased.count(r"cvt\.rn\.f32\.s32") == 0
    assert i2f.count(r"cvt\.rn\.f32\.s32") == 128      # 2 groups × 64 accumulator elements per thread


@pytest.mark.parametrize("kw, word", [(dict(promotion="fast"), "promotion"), (dict(ablate=("load",)), "ablate"),
                                      (dict(ablate="decode"), "ablate")])
def test_v2_options_are_checked(kw, word):
    "v2's mainloop options live in its config and are checked with it; v1's config has no such fields."
    with pytest.raises(ValueError, match=word):
        jit.build(HopperV2Config(**kw), Problem(256, 256, 256, 16))
    with pytest.raises(TypeError, match=list(kw)[0]):
        HopperV1Config(**kw)


@pytest.mark.parametrize("version, R, opts", [("v1", 32, {}), ("v2", 0, {}), ("v2", 32, {}), ("v2", 32, {"promotion": "i2f"})])
def test_ptxas_keeps_wgmma_pipelined(version, R, opts):
    "ptxas serialises every wgmma (advisory C7514/C7515) when a non-wgmma instruction touches an in-flight accumulator."
    res = jit.compile_kernel(CONFIGS[version](**opts), Problem(4352, 3072, 3840, R)).ptxas()
    if res is None:
        pytest.skip("no ptxas on this machine")
    assert res["wgmma_advisories"] == [], res


def test_int4_pairs_only_on_the_verified_tile():
    "An int4 pair on a tile the H200 has not run (a 64-row one faulted there) is refused by name before any launch."
    for cfg in (HopperV1Config(tile_m=64, cluster_n=2), HopperV2Config(tile_m=64, cluster_n=2)):
        with pytest.raises(ValueError, match="tile_m: tile_m=64 with cluster_n=2"):
            jit.check(cfg, Problem(4352, 3072, 3840, 256))
    assert jit.check(HopperV1Config(tile_m=64), Problem(4352, 3072, 3840, 256)).K == 3840
