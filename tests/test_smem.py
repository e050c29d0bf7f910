"""The shared-memory budget solver (w4a4_book/smem.py, chapter nbs/06_budget.ipynb)."""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from w4a4_book.smem import (ARCHS, DTYPE_BITS, LORA_ACCOUNTING, family_of, ProblemSpec, Term, budget_segments,
                            check_config, plot_budgets, problem_of, solve, struct_layout)
from w4a4_book.configs import CONFIGS, BlackwellOrigConfig, HopperV1Config, blackwell_orig_terms, explain


def _budgets():
    "Every named config under both accounting modes."
    for name, (cfg, problem) in CONFIGS.items():
        for acct in LORA_ACCOUNTING:
            try:                          # a config refuses an accounting its family lacks when it is made
                yield f"{name}/{acct}", solve(replace(cfg, lora_accounting=acct), problem)
            except ValueError:
                continue


def _invariants(b):
    assert sum(t.bytes for t in b.terms) + b.padding == b.total
    assert b.padding >= 0
    assert b.total <= b.capacity == ARCHS[b.config.arch].smem_per_block
    assert b.allocated <= b.total
    assert b.fixed + b.stages["main"] * b.per_stage == b.total
    if b.config.lora_accounting == "per_cta":
        assert b.allocated == b.total


@pytest.mark.parametrize("name,b", list(_budgets()))
def test_terms_sum_to_total_within_capacity(name, b):
    _invariants(b)


@pytest.mark.parametrize("name,b", list(_budgets()))
def test_budget_segments_sum_to_total(name, b):
    "The drawn segments are the charged total, and the phantom is what is charged for the LoRA blocks but not held."
    seg = budget_segments(b)
    assert sum(seg.values()) == b.total and min(seg.values()) >= 0
    held = {t.name: t.bytes for t in b.fields}
    assert seg["phantom LoRA bytes"] == sum(t.bytes - held.get(t.name, 0) for t in b.terms if t.per_stage == "lora")
    if b.config.lora_accounting == "per_cta":
        assert seg["phantom LoRA bytes"] == 0


def test_plot_budgets(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    bs = {a: solve(HopperV1Config(cluster_n=2, lora_accounting=a), ProblemSpec(R=128)) for a in ("pair", "per_cta")}
    fig = plot_budgets(bs, path=tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 0
    assert [t.get_text() for t in fig.axes[0].texts if "main stage" in t.get_text()] == ["5 main stages", "3 main stages"]


def test_arch_capacities():
    assert ARCHS["sm_90"].smem_per_block == ARCHS["sm_100"].smem_per_block == 232_448
    assert ARCHS["sm_120"].smem_per_block == 99 * 1024


def test_arch_capacities_match_cute_dsl():
    smem_allocator = pytest.importorskip("cutlass.utils.smem_allocator")
    for arch, facts in ARCHS.items():
        assert smem_allocator.SMEM_CAPACITY_MAP[arch] == facts.smem_per_block


def test_group_size_matches_formats():
    formats = pytest.importorskip("w4a4_book.formats")
    from w4a4_book.smem import GROUP_SIZE
    assert GROUP_SIZE == formats.GROUP_SIZE


@pytest.mark.parametrize("cfg,R", [(HopperV1Config(), r) for r in (16, 32, 128, 256)]
                         + [(BlackwellOrigConfig(tile_m=128, cta_group=1, tile_n=n), r)
                            for n in (128, 256) for r in (32, 128)])
def test_single_cta_accounting_modes_agree(cfg, R):
    per_cta, pair = solve(cfg, ProblemSpec(R=R)), solve(replace(cfg, lora_accounting="pair"), ProblemSpec(R=R))
    assert (per_cta.stages, per_cta.total, per_cta.allocated) == (pair.stages, pair.total, pair.allocated)


@pytest.mark.parametrize("cfg", [HopperV1Config(cluster_n=2), BlackwellOrigConfig(), BlackwellOrigConfig(tile_n=128)])
def test_pair_accounting_costs_stages_at_large_rank(cfg):
    R = ProblemSpec(R=128)
    assert solve(replace(cfg, lora_accounting="pair"), R).stages["main"] < solve(cfg, R).stages["main"]


# (config name, accounting) -> (main stages, lora stages, epilogue stages, charged total, allocated);
# None where not even one main stage fits. A change here is a change in the kernels' pipeline depth.
PINNED = {
    ("v2-r32", "per_cta"): (6, 1, 0, 222_208, 222_208),
    ("v2-r32", "pair"): (6, 1, 0, 222_208, 222_208),
    ("v2-r128", "per_cta"): (3, 1, 0, 219_136, 219_136),
    ("v2-r128", "pair"): (3, 1, 0, 219_136, 219_136),
    ("v2-2cta-r32", "per_cta"): (6, 1, 0, 222_208, 222_208),
    ("v2-2cta-r32", "pair"): (6, 1, 0, 230_400, 222_208),
    ("v2-2cta-r128", "per_cta"): (3, 1, 0, 219_136, 219_136),
    ("v2-2cta-r128", "pair"): (1, 1, 0, 217_088, 184_320),
    ("v1", "per_cta"): (9, 0, 0, 223_232, 223_232),
    ("v1", "pair"): (9, 0, 0, 223_232, 223_232),
    ("v1-r32", "per_cta"): (8, 1, 0, 222_208, 222_208),
    ("v1-r32", "pair"): (8, 1, 0, 222_208, 222_208),
    ("v1-r128", "per_cta"): (5, 1, 0, 219_136, 219_136),
    ("v1-r128", "pair"): (5, 1, 0, 219_136, 219_136),
    ("v1-2cta-r32", "per_cta"): (8, 1, 0, 222_208, 222_208),
    ("v1-2cta-r32", "pair"): (8, 1, 0, 230_400, 222_208),
    ("v1-2cta-r128", "per_cta"): (5, 1, 0, 219_136, 219_136),
    ("v1-2cta-r128", "pair"): (3, 1, 0, 217_088, 184_320),
    ("orig-256x256-r32", "per_cta"): (5, 1, 2, 228_352, 228_352),
    ("orig-256x256-r32", "pair"): (4, 1, 5, 230_400, 214_016),
    ("orig-256x256-r128", "per_cta"): (3, 1, 6, 232_448, 232_448),
    ("orig-256x256-r128", "pair"): (2, 1, 2, 226_304, 160_768),
    ("orig-256x128-r128", "per_cta"): (5, 1, 4, 226_304, 226_304),
    ("orig-256x128-r128", "pair"): (4, 1, 2, 230_400, 181_248),
    ("orig-256x128-r128-l2", "per_cta"): (4, 2, 2, 230_400, 230_400),
    ("orig-256x128-r128-l2", "pair"): None,
    ("orig-256x256-r32", "pair_lu"): (4, 1, 6, 230_400, 222_208),
    ("orig-256x256-r128", "pair_lu"): (3, 1, 2, 232_448, 199_680),
    ("orig-256x128-r128", "pair_lu"): (5, 1, 2, 226_304, 209_920),
    ("orig-256x128-r128-l2", "pair_lu"): (2, 2, 5, 230_400, 197_632),     # c1d209c's budget: 7296e90's "from 4 to 2"
    ("pg-r32", "per_cta"): (4, 1, 2, 206_848, 206_848),
    ("pg-r32", "pair"): (4, 1, 2, 206_848, 206_848),
    ("pg-r128", "per_cta"): (2, 1, 2, 198_656, 198_656),
    ("pg-r128", "pair"): (2, 1, 2, 198_656, 198_656),
    ("pg-2cta-r32", "per_cta"): (4, 1, 2, 206_848, 206_848),
    ("pg-2cta-r32", "pair"): (4, 1, 2, 215_040, 206_848),
    ("pg-2cta-r128", "per_cta"): (2, 1, 2, 198_656, 198_656),
    ("pg-2cta-r128", "pair"): (2, 1, 2, 231_424, 198_656),
    ("pg-smem-r32", "per_cta"): (6, 1, 2, 216_064, 216_064),
    ("pg-smem-r32", "pair"): (6, 1, 2, 216_064, 216_064),
}


def test_pinned_table_covers_named_configs():
    assert set(PINNED) == {(n, a) for n in CONFIGS for a in family_of(CONFIGS[n][0]).accountings}


def test_hopper_pairs_refuse_the_lu_only_mode():
    "A Hopper pair splits only LU, so `pair` is its whole mistake and `pair_lu` a duplicate, refused by name."
    for cfg in (HopperV1Config(cluster_n=2), CONFIGS["pg-2cta-r32"][0]):
        with pytest.raises(ValueError, match="lora_accounting='pair_lu'.*splits only LU"):
            solve(replace(cfg, lora_accounting="pair_lu"), ProblemSpec(R=32))
    assert BlackwellOrigConfig.rules.accountings == LORA_ACCOUNTING


@pytest.mark.parametrize("key", list(PINNED))
def test_pinned_stage_counts(key):
    name, acct = key
    cfg, problem = CONFIGS[name]
    cfg = replace(cfg, lora_accounting=acct)
    if PINNED[key] is None:
        with pytest.raises(ValueError, match="^R="):
            solve(cfg, problem)
        return
    b = solve(cfg, problem)
    assert (b.stages["main"], b.stages["lora"], b.stages["epi"], b.total, b.allocated) == PINNED[key]


@pytest.mark.parametrize("bad,field,exc", [
    (dict(tile_m=96), "tile_m", ValueError), (dict(tile_m=512), "tile_m", ValueError),
    (dict(tile_n=100), "tile_n", ValueError), (dict(tile_n=0), "tile_n", ValueError),
    (dict(tile_k=96), "tile_k", ValueError), (dict(tile_k=32), "tile_k", ValueError),
    (dict(cluster_n=4), "cluster_n", ValueError), (dict(decode_stages=0), "decode_stages", ValueError),
    (dict(lora_stages=0), "lora_stages", ValueError), (dict(stages=0), "stages", ValueError),
    (dict(max_stages=0), "max_stages", ValueError),
    (dict(arch="sm_89"), "arch", ValueError), (dict(arch="sm_100"), "arch", ValueError),
    (dict(fmt="int8"), "fmt", ValueError), (dict(fmt="nvfp4"), "fmt", ValueError),
    (dict(lora_accounting="cluster"), "lora_accounting", ValueError),
    (dict(tile_n=128.0), "tile_n", TypeError),
])
def test_check_config_names_the_field_hopper(bad, field, exc):
    with pytest.raises(exc, match=rf"^{field}\b"):
        check_config(HopperV1Config(**bad))


@pytest.mark.parametrize("bad,field", [
    (dict(tile_m=128), "tile_m"), (dict(cta_group=1), "tile_m"), (dict(cta_group=3), "cta_group"),
    (dict(tile_n=192), "tile_n"), (dict(tile_k=96), "tile_k"), (dict(epi_stages=0), "epi_stages"),
    (dict(arch="sm_90"), "arch"), (dict(fmt="int4"), "fmt"),
])
def test_check_config_names_the_field_blackwell(bad, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        check_config(BlackwellOrigConfig(**bad))


@pytest.mark.parametrize("cfg,bad,field,exc", [
    (HopperV1Config(), dict(R=24), "R", ValueError), (HopperV1Config(), dict(R=-16), "R", ValueError),
    (HopperV1Config(), dict(R=True), "R", ValueError), (HopperV1Config(), dict(K=0), "K", ValueError),
    (HopperV1Config(), dict(out_dtype="float8_e4m3fn"), "out_dtype", ValueError),
    (HopperV1Config(), dict(scale_dtype="float32"), "scale_dtype", ValueError),
    (HopperV1Config(), dict(lora_dtype="float32"), "lora_dtype", ValueError),
    (HopperV1Config(), dict(out_dtype="int3"), "out_dtype", ValueError),
    (BlackwellOrigConfig(), dict(out_dtype="float32"), "out_dtype", ValueError),
    (BlackwellOrigConfig(), dict(R=8), "R", ValueError),
    (BlackwellOrigConfig(), dict(out_dtype="bfloat16"), "lora_dtype", ValueError),   # its LoRA blocks: the output's
])
def test_the_problem_is_refused_by_name(cfg, bad, field, exc):
    "A problem the config's kernel cannot build is refused naming the problem's field, before any budget."
    with pytest.raises(exc, match=rf"^{field}\b"):
        problem_of(cfg, ProblemSpec(**bad))


def test_a_config_needs_its_problem():
    with pytest.raises(TypeError, match="^problem: a hopper_v1 config holds tuning alone"):
        solve(HopperV1Config(), None)
    with pytest.raises(TypeError, match="^problem: must be a ProblemSpec or an operands.Problem"):
        solve(HopperV1Config(), 32)


def test_check_config_rejects_other_types():
    with pytest.raises(TypeError, match="cfg must be"):
        check_config(dict(tile_m=128))


def test_stage_override_and_caps():
    R32 = ProblemSpec(R=32)
    assert solve(HopperV1Config(stages=2), R32).stages["main"] == 2
    assert solve(HopperV1Config(max_stages=3), R32).stages["main"] == 3
    assert solve(HopperV1Config(), ProblemSpec(R=32, K=256)).stages["main"] == 2
    assert solve(HopperV1Config(), ProblemSpec(R=32, K=100_000)).stages["main"] == 8
    with pytest.raises(ValueError, match=r"^stages=9"):
        solve(HopperV1Config(stages=9), R32)
    with pytest.raises(ValueError, match=r"^K="):
        solve(HopperV1Config(), ProblemSpec(K=0))


def test_no_fit_names_the_culprit():
    with pytest.raises(ValueError, match=r"^R=256"):
        solve(HopperV1Config(lora_stages=2), ProblemSpec(R=256))
    with pytest.raises(ValueError, match=r"^decode_stages=8"):
        solve(HopperV1Config(decode_stages=8), ProblemSpec())
    with pytest.raises(ValueError, match=r"^tile_m="):
        solve(HopperV1Config(tile_m=256, tile_n=256, tile_k=256), ProblemSpec())


def test_solved_stage_count_is_the_largest_that_fits():
    for _, b in _budgets():
        more = replace(b.config, stages=b.stages["main"] + 1)
        with pytest.raises(ValueError, match=r"^stages="):
            solve(more, b.problem)


def test_term_validation():
    with pytest.raises(ValueError, match="^dtype="):
        Term("x", 8, 8, "int7", None, "")
    with pytest.raises(ValueError, match="^per_stage="):
        Term("x", 8, 8, "int64", "k", "")
    with pytest.raises(ValueError, match="^bytes="):
        Term("x", 3, 2, "bfloat16", None, "")
    with pytest.raises(ValueError, match="^align="):
        Term("x", 8, 24, "int64", None, "")


def test_explain():
    text, (cfg, problem) = explain("v1-2cta-r128"), CONFIGS["v1-2cta-r128"]
    assert text.splitlines()[0] == f"{cfg.label} R=128" == solve(cfg, problem).label
    assert "lora_up" in text and "(alignment)" in text
    assert "charged but never allocated" in explain(replace(cfg, lora_accounting="pair"), problem)
    with pytest.raises(TypeError, match="^problem: 'v1' names its own problem"):
        explain("v1", problem)
    with pytest.raises(ValueError, match="^cfg="):
        explain("no-such-config")


# ---- the layout rule is cute.struct's rule ----

_CUTE_TYPES = {"int64": "Int64", "int32": "Int32", "uint32": "Uint32", "float32": "Float32", "bfloat16": "BFloat16", "float16": "Float16",
               "uint8": "Uint8", "int8": "Int8", "float8_e4m3fn": "Float8E4M3FN", "float4_e2m1fn": "Float4E2M1FN"}


def _cute_struct(terms):
    "A real cute.struct declaring the non-empty `terms` in order, as a kernel builds its SharedStorage."
    cutlass = pytest.importorskip("cutlass")
    cute = pytest.importorskip("cutlass.cute")
    ann = {t.name: cute.struct.Align[cute.struct.MemRange[getattr(cutlass, _CUTE_TYPES[t.dtype]), t.elements], t.align]
           for t in terms if t.bytes}
    return cute.struct(type("SharedStorage", (), {"__annotations__": ann}))


@pytest.mark.parametrize("name,b", list(_budgets()))
def test_budget_fields_match_cute_struct(name, b):
    "The struct a kernel builds from `budget.fields` has `budget.allocated` bytes, and the per_cta budget's offsets."
    s = _cute_struct(b.fields)
    per_cta = family_of(b.config).terms(b.config, b.problem, b.stages, "per_cta")
    assert s.size_in_bytes() == b.allocated == struct_layout(per_cta)[1]
    if b.config.lora_accounting == "per_cta":
        assert (s._offsets, s.size_in_bytes()) == (b.offsets, b.total)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.sampled_from([1, 2, 4, 8, 128, 1024]), st.sampled_from(sorted(DTYPE_BITS))),
                min_size=1, max_size=8))
def test_struct_layout_is_cute_struct(spec):
    terms = [Term(f"f{i}", n * max(1, DTYPE_BITS[d] // 8), a, d, None, "") for i, (n, a, d) in enumerate(spec)]
    if not any(t.bytes for t in terms):
        return
    offsets, size = struct_layout(terms)
    s = _cute_struct(terms)
    assert (s._offsets, s.size_in_bytes()) == (offsets, size)


# ---- properties over the config space ----

ranks = st.integers(0, 16).map(lambda x: 16 * x)
hopper_cases = st.tuples(st.builds(
    HopperV1Config, tile_m=st.sampled_from([64, 128, 192, 256]), tile_n=st.integers(1, 32).map(lambda x: 8 * x),
    tile_k=st.sampled_from([64, 128, 192, 256]), cluster_n=st.sampled_from([1, 2]), lora_stages=st.integers(1, 3),
    decode_stages=st.integers(1, 3),
    lora_accounting=st.sampled_from(HopperV1Config.rules.accountings), max_stages=st.none() | st.integers(1, 12)),
    st.builds(ProblemSpec, R=ranks, out_dtype=st.sampled_from(["bfloat16", "float16", "float32"])))
blackwell_cases = st.tuples(st.sampled_from([1, 2]).flatmap(lambda c: st.builds(
    BlackwellOrigConfig, cta_group=st.just(c), tile_m=st.just(128 * c), tile_n=st.sampled_from([128, 256]),
    tile_k=st.sampled_from([64, 128, 256]), lora_stages=st.integers(1, 3), epi_stages=st.integers(1, 4),
    lora_accounting=st.sampled_from(LORA_ACCOUNTING))),
    st.sampled_from(["float16", "bfloat16"]).flatmap(lambda d: st.builds(
        ProblemSpec, R=ranks, out_dtype=st.just(d), lora_dtype=st.just(d))))


@settings(max_examples=300, deadline=None)
@given(hopper_cases | blackwell_cases)
def test_solve_never_exceeds_capacity_and_terms_sum(case):
    cfg, problem = case
    try:
        b = solve(cfg, problem)
    except ValueError as e:
        assert str(e).split("=")[0] in {"R", "decode_stages", "epi_stages", "tile_m"}
        return
    _invariants(b)
    per_cta = solve(replace(cfg, lora_accounting="per_cta"), problem)
    assert per_cta.stages["main"] >= b.stages["main"]


# ---- the Blackwell model against the CUTLASS helpers the original sizes its buffers with ----

_PROBE = r'''
import json
import cutlass, cutlass.cute as cute, cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100
import cutlass.utils.blockscaled_layout as bs
from cutlass.cute.nvgpu import tcgen05
out = {}
@cute.jit
def probe(m: cutlass.Constexpr, n: cutlass.Constexpr, k: cutlass.Constexpr, two: cutlass.Constexpr, R: cutlass.Constexpr):
    K = tcgen05.OperandMajorMode.K
    cg = tcgen05.CtaGroup.TWO if two else tcgen05.CtaGroup.ONE
    ab, sf, c = cutlass.Float4E2M1FN, cutlass.Float8E4M3FN, cutlass.Float16
    mma = sm100.make_blockscaled_trivial_tiled_mma(ab, K, K, sf, 16, cg, (m, n))
    tiler = (m, n, k)
    cta = (m // cute.size(mma.thr_id.shape), n, tiler[2])
    epi = sm100.compute_epilogue_tile_shape(cta, two, utils.LayoutEnum.ROW_MAJOR, c)
    lora = sm100.make_trivial_tiled_mma(ab_dtype=c, a_leading_mode=K, b_leading_mode=K, acc_dtype=cutlass.Float32,
                                        cta_group=cg, mma_tiler_mn=(m, n))
    out[f"{m},{n},{k},{R}"] = dict(
        mma_k=cute.size(mma.shape_mnk, mode=[2]),
        a_packed=cute.size_in_bytes(ab, sm100.make_smem_layout_a(mma, tiler, ab, 1)),
        b_packed=cute.size_in_bytes(ab, sm100.make_smem_layout_b(mma, tiler, ab, 1)),
        a_scales=cute.size_in_bytes(sf, bs.make_smem_layout_sfa(mma, tiler, 16, 1)),
        b_scales=cute.size_in_bytes(sf, bs.make_smem_layout_sfb(mma, tiler, 16, 1)),
        epilogue=cute.size_in_bytes(c, sm100.make_smem_layout_epi(c, utils.LayoutEnum.ROW_MAJOR, epi, 1)),
        lora_act=cute.size_in_bytes(c, sm100.make_smem_layout_a(lora, (m, n, R), c, 1)),
        lora_up=cute.size_in_bytes(c, sm100.make_smem_layout_b(lora, (m, n, R), c, 1)))
for m, n, k, two, R in %s:
    cute.compile(probe, m, n, k, two, R)
print(json.dumps(out))
'''
_PROBED = [(256, 256, 256, True, 32), (256, 256, 256, True, 128), (256, 128, 256, True, 128), (256, 256, 128, True, 64),
           (128, 256, 256, False, 32), (128, 128, 64, False, 64)]


def test_blackwell_model_matches_cutlass_layouts(tmp_path):
    "Per-stage bytes of the model equal what the sm100 layout helpers allocate (traced on CPU, IR only)."
    pytest.importorskip("cutlass")
    env = {**os.environ, "CUTE_DSL_DRYRUN": "1"}
    script = tmp_path / "probe_sm100_layouts.py"   # the DSL parses its functions from a source file
    script.write_text(_PROBE % repr(_PROBED))
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    probed = json.loads(run.stdout.strip().splitlines()[-1])
    for m, n, k, two, R in _PROBED:
        got = probed[f"{m},{n},{k},{R}"]
        assert 4 * got.pop("mma_k") == BlackwellOrigConfig().tile_k   # the original's tile_k: four NVFP4 MMAs
        cfg = BlackwellOrigConfig(tile_m=m, tile_n=n, cta_group=2 if two else 1, tile_k=k)
        p = problem_of(cfg, ProblemSpec(R=R))
        model = {t.name: t.bytes for t in blackwell_orig_terms(cfg, p, dict(main=1, lora=1, epi=1), "per_cta")}
        assert {name: model[name] for name in got} == got, (m, n, k, two, R)
