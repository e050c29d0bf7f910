"""The sm_100 kernels (chapter 18a), checked without a Blackwell GPU: the host scale-factor layout, the host emulation
of the kernels' arithmetic against the reference, the solver family, compiles for sm_100a (PTX, shared memory,
ptxas) and named errors, for v1, the naive pair and v2 (chapter 18b). The tests marked `sm100` run the kernels on a compute-capability-10 GPU (`pytest -m sm100`)
and are skipped everywhere else: none has run yet."""
import itertools
import subprocess
import sys

import pytest
import torch

import w4a4_book.gemm as gemm
import w4a4_book.registry as registry
import w4a4_book.smem as smem
import w4a4_book.configs as configs
from w4a4_book.checks import SM100_V1_CASES, SM100_V2_CASES
from w4a4_book.formats import quantize
from w4a4_book.operands import Problem, check_problem
from w4a4_book.reference import w4a4_gemm_ref

sm100 = pytest.importorskip("w4a4_book.kernels.sm100_parts")
v1 = pytest.importorskip("w4a4_book.kernels.sm100_v1")
v2 = pytest.importorskip("w4a4_book.kernels.sm100_v2")


def _cfg(cta_group=1, cls=configs.Sm100V1Config, **kw):
    return cls(cta_group=cta_group, tile_m=128 * cta_group, **kw)


def _cfg2(cta_group=2, **kw):
    return _cfg(cta_group, configs.Sm100V2Config, **kw)


def _operands(M, N, K, R, seed=0, wcs=True, bias=True):
    g = torch.Generator().manual_seed(seed)
    A = quantize(torch.randn(M, K, generator=g), "nvfp4")
    W = quantize(torch.randn(N, K, generator=g) * 0.05, "nvfp4")
    la = (torch.randn(M, R, generator=g) * 0.5).bfloat16() if R else None
    lu = (torch.randn(N, R, generator=g) * 0.1).bfloat16() if R else None
    s = (torch.rand(N, generator=g) + 0.5).bfloat16() if wcs else None
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    return A, W, la, lu, s, b


# ---------------------------------------------------------------- host parts
@pytest.mark.parametrize("rows, groups", [(128, 4), (200, 20), (64, 240), (1, 1)])
def test_scale_layout_round_trip_and_offsets(rows, groups):
    s = (torch.rand(groups, rows) * 100).to(torch.float8_e4m3fn)
    buf = sm100.to_mma_scales(s)
    assert buf.dtype == torch.uint8 and buf.numel() == sm100.mma_scales_size(rows, groups)
    assert torch.equal(sm100.from_mma_scales(buf, rows, groups).view(torch.uint8), s.view(torch.uint8))
    su = s.view(torch.uint8)
    for m, g in itertools.product(range(rows), range(groups)):
        assert buf[sm100.mma_scale_offset(m, g, groups)] == su[g, m]
    assert buf.numel() - rows * groups == (buf == 0).sum() - (su == 0).sum()   # the padding is zero scales


def test_scale_layout_rejects_other_dtypes():
    with pytest.raises(TypeError, match="^scales:"):
        sm100.to_mma_scales(torch.ones(4, 128))


EMULATION_GRID = [(64, 256, 256, 0), (200, 256, 512, 32), (128, 512, 1024, 128), (256, 256, 768, 16),
                  (130, 512, 512, 64)]


@pytest.mark.parametrize("M, N, K, R", EMULATION_GRID)
def test_emulation_matches_reference(M, N, K, R):
    "The kernels' arithmetic, emulated: within fp32 reordering of the reference, plus 2^-8 of the LoRA term (its bf16 pre-scale)."
    A, W, la, lu, s, b = _operands(M, N, K, R)
    ref = w4a4_gemm_ref(A, W, la, lu, s, b)
    emu = sm100.emulate_sm100(A, W, la, lu, s, b, out_dtype=torch.float32)
    lora = (la.float().abs() @ lu.float().abs().T * s.float()).max().item() if R else 0.0
    assert (emu - ref).abs().max().item() <= 2**-8 * lora + 1e-5 * ref.abs().max().item()
    out = sm100.emulate_sm100(A, W, la, lu, s, b)            # the kernel's bf16 output: one more rounding
    torch.testing.assert_close(out.float(), emu, rtol=2**-8, atol=1e-6)


def test_lora_prescale_needs_bfloat16():
    "The choice the kernels make: 1/(gs_a*gs_w) is out of fp16's range for unit-scale data, inside bf16's."
    A, W, *_ = _operands(64, 256, 256, 0)
    gs = (A.global_scale * W.global_scale).reshape(1)
    assert torch.isinf((1 / gs).half()).all() and torch.isfinite(sm100.lora_up_prescaled(torch.ones(8, 16), gs)).all()


def test_lora_steps_spread_over_k():
    for steps, k_tiles in [(2, 15), (8, 15), (8, 3), (1, 1)]:
        at = [sm100.lora_step_at(j, steps, k_tiles) for j in range(steps)]
        assert at == sorted(at) and 0 <= at[0] and at[-1] < k_tiles


# ---------------------------------------------------------------- the solver family
def test_pair_loses_the_stages_the_solver_says():
    for R, per_cta, pair in [(32, 5, 4), (128, 3, 2)]:
        b = {a: smem.solve(_cfg(2, lora_accounting=a), smem.ProblemSpec(R=R)) for a in smem.LORA_ACCOUNTING}
        assert (b["per_cta"].stages["main"], b["pair"].stages["main"]) == (per_cta, pair)
        assert b["per_cta"].total == b["per_cta"].allocated and b["pair"].total > b["pair"].allocated


def test_config_errors_name_the_field():
    for kw, field in [(dict(tile_n=192), "tile_n"), (dict(arch="sm_90"), "arch"), (dict(lora_stages=2), "lora_stages")]:
        with pytest.raises(ValueError, match=f"{field}="):
            smem.check_config(_cfg(**kw))
    with pytest.raises(ValueError, match="^lora_dtype='float16'"):      # the pre-scaled up-projection needs bf16
        smem.solve(_cfg(), smem.ProblemSpec(R=32, lora_dtype="float16"))
    with pytest.raises(ValueError, match="tile_m=128"):
        smem.check_config(configs.Sm100V1Config(cta_group=2))


# ---------------------------------------------------------------- compiled for sm_100a, in a subprocess
COMPILES = list(SM100_V1_CASES)          # (cta_group, R, accounting): the cases whose PTX digests the package holds
# v2 (cta_group, R, accounting, tile_n, acc_stages): those cases, and the two more that
# `test_v2_pair_loses_compiled_stages` compares (each R under the other accounting)
COMPILES_V2 = [*SM100_V2_CASES, (2, 32, "pair", 256, 1), (2, 128, "per_cta", 256, 1)]


def _v2_config(cg, R, acct, tile_n, acc_stages):
    return _cfg2(cg, lora_accounting=acct, tile_n=tile_n, acc_stages=acc_stages)


@pytest.fixture(scope="module")
def reports():
    "One subprocess (CUTE_DSL_ARCH=sm_90a) compiles every config of `COMPILES` and `COMPILES_V2` for sm_100a on fake tensors."
    import os, pickle, tempfile
    cases = [((cg, R, a), _cfg(cg, lora_accounting=a), R) for cg, R, a in COMPILES]
    cases += [(("v2", *key), _v2_config(*key), key[1]) for key in COMPILES_V2]
    code = ("import pickle, sys; import w4a4_book.jit as j, w4a4_book.registry as r; out = {}\n"
            "for key, c, R in pickle.load(open(sys.argv[1], 'rb')):\n"
            "    out[key] = j.compile_kernel(c, j.example_problem(r.spec_for(c), 4352, 3072, 3840, R))\n"
            "pickle.dump(out, open(sys.argv[2], 'wb'))")
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in.pkl"), os.path.join(d, "out.pkl")
        pickle.dump(cases, open(src, "wb"))
        r = subprocess.run([sys.executable, "-c", code, src, dst], capture_output=True, text=True,
                           env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"})
        assert r.returncode == 0, r.stderr[-4000:]
        return pickle.load(open(dst, "rb"))


@pytest.mark.parametrize("cg, R, acct", COMPILES)
def test_compiled_storage_equals_solver(reports, cg, R, acct):
    rep = reports[cg, R, acct]
    want = smem.solve(_cfg(cg, lora_accounting=acct), rep.problem)
    assert rep.smem_bytes == want.allocated == rep.budget.allocated
    assert rep.budget.stages == want.stages
    if acct == "per_cta": assert want.total == want.allocated


@pytest.mark.parametrize("cg, R, acct", COMPILES)
def test_ptx(reports, cg, R, acct):
    rep = reports[cg, R, acct]
    ins = rep.instructions
    assert rep.count(rf"tcgen05\.mma\.cta_group::{cg}\.kind::mxf4nvf4\.block_scale") == 4   # one K-tile: 4 x 64 deep
    assert rep.count(r"tcgen05\.mma\.cta_group::\d") == 4 + R // 16                     # + the LoRA steps, unrolled
    assert ins["tcgen05.alloc"] == ins["tcgen05.dealloc"] == 1
    assert rep.count(rf"tcgen05\.alloc\.cta_group::{cg}\.") == 1
    assert ins["local memory"] == 0 and ins["TMA store"] > 0
    assert rep.count(r"\.target sm_100a") == 1
    if cg == 2:
        assert rep.count(r"tcgen05\.commit\.cta_group::2\.\S*multicast::cluster") > 0   # the leader frees both CTAs
        assert rep.count(r"cp\.async\.bulk\.tensor\.\S*multicast::cluster\S*cta_group::2") > 0


@pytest.mark.parametrize("cg, R, acct", COMPILES[:3])
def test_ptxas_where_available(reports, cg, R, acct):
    res = reports[cg, R, acct].ptxas()
    if res is None:
        pytest.skip("no ptxas on this machine")
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0


@pytest.mark.parametrize("kernel, report, in_ptx", [
    ("v1", ("TMEM columns", "tcgen05.mma (block-scaled)"), "cta_group::2"),
    ("v2", ("TMEM columns: 304 used", "tcgen05.mma (block-scaled) 4"), "kind::mxf4nvf4.block_scale")])
def test_cli_compiles_the_pair(tmp_path, kernel, report, in_ptx):
    "`w4a4-book compile v1|v2 --arch sm_100a --fmt nvfp4 --cta-group 2 --ptx FILE` in a subprocess, as a reader runs it."
    ptx = tmp_path / "k.ptx"
    main = "import sys; from w4a4_book.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", main, "compile", kernel, "--arch", "sm_100a", "--fmt", "nvfp4",
                        "--cta-group", "2", "--ptx", str(ptx)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(x in r.stdout for x in report)
    assert in_ptx in ptx.read_text(errors="replace")


# ---------------------------------------------------------------- bad input, before any launch
def test_bad_input_names_the_argument():
    req = v1.W4A4GemmSm100V1.requirements(_cfg())
    nv = dict(scale_dtype=torch.float8_e4m3fn, fmt="nvfp4")
    with pytest.raises(ValueError, match="^act: K=320"):
        check_problem(req, Problem(256, 256, 320, 0, **nv))
    with pytest.raises(ValueError, match="^wgt: N=384"):
        check_problem(req, Problem(256, 384, 512, 0, **nv))
    with pytest.raises(ValueError, match="^act: format 'int4'"):
        check_problem(req, Problem(256, 256, 512, 0))
    with pytest.raises(TypeError, match="^lora_act"):
        check_problem(req, Problem(256, 256, 512, 32, lora_dtype=torch.float16, **nv))
    with pytest.raises(ValueError, match="^fmt"):
        registry.find_kernel("v1", "int4_pg", "sm_100a")
    with pytest.raises(ValueError, match="^fmt"):
        registry.find_kernel("v1", "nvfp4", "sm_90a")
    assert req.capability == (10, 0)


def test_not_a_default():
    assert all(arch != "sm_100a" for arch, _ in registry.DEFAULTS)
    with pytest.raises(ValueError, match="^fmt"):
        registry.default_config("nvfp4")


def test_cpu_tensors_rejected_before_launch():
    A, W, la, lu, s, b = _operands(256, 256, 512, 32)
    with pytest.raises(ValueError, match="^act: must be on a CUDA device"):
        gemm.gemm_w4a4(A, W, la, lu, s, b, config=_cfg())


# ---------------------------------------------------------------- on a B200 (compute capability 10): never run yet
def _is_sm100():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


B200_GRID = [(1, 256, 256, 512, 0), (1, 300, 512, 1024, 32), (2, 512, 512, 768, 128), (2, 200, 256, 512, 16)]


@pytest.mark.sm100
@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm100(), reason="needs a compute-capability-10 GPU (B200, GB200)")
@pytest.mark.parametrize("cg, M, N, K, R", B200_GRID)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_on_b200(cg, M, N, K, R, out_dtype):
    A, W, la, lu, s, b = (t.cuda() if t is not None else None for t in _operands(M, N, K, R))
    out = gemm.gemm_w4a4(A, W, la, lu, s, b, out_dtype=out_dtype, config=_cfg(cg))
    cpu = lambda t: t.cpu() if t is not None else None
    emu = sm100.emulate_sm100(A.to("cpu"), W.to("cpu"), cpu(la), cpu(lu), cpu(s), cpu(b), out_dtype=out_dtype)
    ref = w4a4_gemm_ref(A.to("cpu"), W.to("cpu"), cpu(la), cpu(lu), cpu(s), cpu(b))
    torch.testing.assert_close(out.cpu().float(), emu.float(), rtol=2**-7, atol=1e-3 * ref.abs().max().item())


# ---------------------------------------------------------------- v2 (chapter 18b), on CPU
def test_v2_solver_family_and_tmem():
    "v2's budget is the solver's Blackwell family: the pair loses the stages the solver says; TMEM is counted."
    for R, per_cta, pair in [(32, 5, 4), (128, 3, 2)]:
        b = {a: smem.solve(_cfg2(lora_accounting=a), smem.ProblemSpec(R=R)) for a in smem.LORA_ACCOUNTING}
        assert (b["per_cta"].stages["main"], b["pair"].stages["main"]) == (per_cta, pair)
    assert configs.sm100_tmem_columns(_cfg2())["total"] == 256 + 16 + 32
    assert configs.sm100_tmem_columns(_cfg2(tile_n=128, acc_stages=2))["total"] == 2 * 128 + 16 + 16
    with pytest.raises(ValueError, match="^acc_stages=2: .* 560 TMEM columns > 512"):
        smem.check_config(_cfg2(acc_stages=2))
    with pytest.raises(ValueError, match="^acc_stages=3"):
        smem.check_config(_cfg2(tile_n=128, acc_stages=3))
    acc = {t.name: t.bytes for t in smem.solve(_cfg2(tile_n=128, acc_stages=2), smem.ProblemSpec()).fields}
    assert acc["acc_full"] == acc["acc_empty"] == 2 * smem.MBARRIER_BYTES


def test_v2_roles_are_data():
    r = v2.ROLES
    assert (r.threads, r.tmem_threads, r.epilogue_warps, r.mma_warp, r.load_warp) == (192, 160, (0, 1, 2, 3), 4, 5)
    with pytest.raises(ValueError, match="^epilogue_warps="):
        v2.Sm100Roles(epilogue_warps=(1, 2, 3, 4))
    with pytest.raises(ValueError, match="^mma_warp="):
        v2.Sm100Roles(mma_warp=6)


def test_v2_scheduler_covers_every_tile_once():
    from w4a4_book.kernels.scheduler import PersistentRaster, raster
    assert v2.W4A4GemmSm100V2.__init__.__defaults__ == (PersistentRaster,)      # the Hopper kernels' scheduler
    for m_tiles, n_tiles, cg, sms in [(17, 12, 2, 148), (3, 2, 1, 132), (40, 12, 2, 148)]:
        s = PersistentRaster(m_tiles, n_tiles, 1, tile_ctas=cg)
        c = s.clusters(sms)
        assert c <= sms // cg
        seen = [raster(k + i * c, m_tiles, n_tiles, s.group_m) for k in range(c) for i in range(s.count(k, c))]
        assert sorted(seen) == sorted((m, n) for m in range(m_tiles) for n in range(n_tiles))


@pytest.mark.parametrize("key", COMPILES_V2)
def test_v2_compiled_storage_equals_solver(reports, key):
    "The compiled SharedStorage is the solver's, in both LoRA accountings (pair: the charged total exceeds it)."
    rep = reports[("v2", *key)]
    want = smem.solve(_v2_config(*key), rep.problem)
    assert rep.smem_bytes == want.allocated == rep.budget.allocated
    assert rep.budget.stages == want.stages
    assert (want.total == want.allocated) == (key[2] == "per_cta" or key[1] == 0)


@pytest.mark.parametrize("R, per_cta, pair", [(32, 5, 4), (128, 3, 2)])
def test_v2_pair_loses_compiled_stages(reports, R, per_cta, pair):
    a, b = reports[("v2", 2, R, "per_cta", 256, 1)], reports[("v2", 2, R, "pair", 256, 1)]
    assert (a.budget.stages["main"], b.budget.stages["main"]) == (per_cta, pair)
    assert b.smem_bytes < a.smem_bytes


@pytest.mark.parametrize("key", COMPILES_V2)
def test_v2_ptx(reports, key):
    cg, R = key[0], key[1]
    rep = reports[("v2", *key)]
    ins = rep.instructions
    assert rep.count(rf"tcgen05\.mma\.cta_group::{cg}\.kind::mxf4nvf4\.block_scale") == 4   # one K-tile, in the loop
    assert rep.count(rf"tcgen05\.mma\.cta_group::{cg}\.kind::f16") == R // 16              # LoRA: 16-bit, same accumulator
    assert ins["tcgen05.alloc"] == ins["tcgen05.dealloc"] == 1
    assert rep.count(rf"tcgen05\.alloc\.cta_group::{cg}\.") == 1
    assert ins["local memory"] == 0 and ins["TMA store"] > 0
    assert rep.count(r"\.target sm_100a") == 1
    assert rep.count(r"bar\.sync\s+1,\s*160;|barrier\.sync(?:\.aligned)?\s+1,\s*160;") >= 1       # TMEM_ALLOC: MMA + epilogue warps
    if cg == 2:
        assert rep.count(r"tcgen05\.commit\.cta_group::2\.\S*multicast::cluster") > 0
        assert rep.count(r"cp\.async\.bulk\.tensor\.\S*multicast::cluster\S*cta_group::2") > 0


@pytest.mark.parametrize("key", COMPILES_V2[:3])
def test_v2_ptxas_where_available(reports, key):
    res = reports[("v2", *key)].ptxas()
    if res is None:
        pytest.skip("no ptxas on this machine")
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0
    assert res["registers"] <= v2.ROLES.max_registers




def test_v2_is_registered_opt_in():
    spec = registry.find_kernel("v2", "nvfp4", "sm_100a")
    assert (spec.config, spec.cls, spec.mainloop) == (configs.Sm100V2Config, "W4A4GemmSm100V2", "block_scaled")
    assert all(arch != "sm_100a" for arch, _ in registry.DEFAULTS)


def test_v2_bad_input_names_the_argument():
    req = v2.W4A4GemmSm100V2.requirements(_cfg2())
    nv = dict(scale_dtype=torch.float8_e4m3fn, fmt="nvfp4")
    with pytest.raises(ValueError, match="^act: K=320"):
        check_problem(req, Problem(256, 256, 320, 0, **nv))
    with pytest.raises(ValueError, match="^wgt: N=384"):
        check_problem(req, Problem(256, 384, 512, 0, **nv))
    with pytest.raises(TypeError, match="^lora_act"):
        check_problem(req, Problem(256, 256, 512, 32, lora_dtype=torch.float16, **nv))
    A, W, la, lu, s, b = _operands(256, 256, 512, 32)
    with pytest.raises(ValueError, match="^act: must be on a CUDA device"):
        gemm.gemm_w4a4(A, W, la, lu, s, b, config=_cfg2())


# v2's order of operations is v1's (K-tiles in order, the LoRA steps after the K-tiles `lora_step_at` names, the
# same epilogue): `emulate_sm100` is its emulation too.
B200_GRID_V2 = [(2, 256, 256, 512, 0, 256, 1), (2, 1000, 512, 1024, 32, 256, 1), (2, 600, 768, 768, 128, 256, 1),
                (1, 300, 512, 1024, 32, 256, 1), (2, 700, 384, 512, 16, 128, 2)]


@pytest.mark.sm100
@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm100(), reason="needs a compute-capability-10 GPU (B200, GB200)")
@pytest.mark.parametrize("cg, M, N, K, R, tile_n, acc_stages", B200_GRID_V2)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_v2_matches_emulation_on_b200(cg, M, N, K, R, tile_n, acc_stages, out_dtype):
    A, W, la, lu, s, b = (t.cuda() if t is not None else None for t in _operands(M, N, K, R))
    out = gemm.gemm_w4a4(A, W, la, lu, s, b, out_dtype=out_dtype, config=_cfg2(cg, tile_n=tile_n, acc_stages=acc_stages))
    cpu = lambda t: t.cpu() if t is not None else None
    emu = sm100.emulate_sm100(A.to("cpu"), W.to("cpu"), cpu(la), cpu(lu), cpu(s), cpu(b), out_dtype=out_dtype)
    ref = w4a4_gemm_ref(A.to("cpu"), W.to("cpu"), cpu(la), cpu(lu), cpu(s), cpu(b))
    torch.testing.assert_close(out.cpu().float(), emu.float(), rtol=2**-7, atol=1e-3 * ref.abs().max().item())
