"""The exact-integer mainloop (int4_pg): compile checks on any machine; on an sm_90 GPU, the correctness grid against the
exact int64 reference, and one compiled kernel serving every M."""
import pytest, torch
from dataclasses import replace
from w4a4_book import smem, configs, jit, registry, gemm
from w4a4_book.formats import quantize
from w4a4_book.operands import Problem
from w4a4_book.reference import w4a4_gemm_exact
from w4a4_book.configs import HopperPgConfig, HopperPgSmemConfig, HopperPgStreamKConfig, HopperPgV1Config


def pg_problem(M, N, K, R=32, out_dtype=torch.bfloat16):
    return Problem(M, N, K, R, scale_dtype=torch.uint8, lora_dtype=out_dtype, out_dtype=out_dtype, fmt="int4_pg", act_fmt="int4_pg")


SMEM_VECTORS = dict(epi_vectors="smem")


@pytest.mark.parametrize("kw, R", [({}, 32), (dict(cluster_n=2), 32), ({}, 0), ({}, 128), (dict(tile_m=128), 256),
                                   (dict(cluster_n=2, lora_accounting="pair"), 128), (SMEM_VECTORS, 32), (SMEM_VECTORS, 0),
                                   (dict(SMEM_VECTORS, cluster_n=2), 128), (dict(SMEM_VECTORS, tile_m=128), 256),
                                   (dict(SMEM_VECTORS, tile_m=224), 32), (dict(SMEM_VECTORS, tile_m=224, cluster_n=2), 128),
                                   (dict(tile_m=192), 0), (dict(SMEM_VECTORS, tile_m=208, epi_tile_m=16, epi_deferred=True), 32),
                                   (dict(SMEM_VECTORS, tile_m=224, epi_deferred=True, cluster_n=2), 128)])
def test_compiles_with_the_solvers_storage_and_no_serialisation(kw, R):
    rep = jit.compile_kernel(HopperPgConfig(**kw), pg_problem(4352, 3072, 3840, R))
    check_compiled(rep, R, a_in_registers=True)
    check_vectors(rep)


@pytest.mark.parametrize("kw, R", [({}, 32), (dict(cluster_n=2), 128), ({}, 0), (SMEM_VECTORS, 32)])
def test_decode_warpgroup_variant_compiles(kw, R):
    rep = jit.compile_kernel(HopperPgSmemConfig(**kw), pg_problem(4352, 3072, 3840, R))
    check_compiled(rep, R, a_in_registers=False)
    check_vectors(rep)


@pytest.mark.parametrize("kw, R", [({}, 32), (dict(cluster_n=2, tile_m=128, lora_accounting="pair"), 128), ({}, 0),
                                   (dict(SMEM_VECTORS, tile_m=128), 32)])
def test_v1_compiles_with_the_solvers_storage_and_no_serialisation(kw, R):
    rep = jit.compile_kernel(HopperPgV1Config(**kw), pg_problem(4352, 3072, 3840, R))
    check_compiled(rep, R, a_in_registers=True)
    check_vectors(rep)


@pytest.mark.parametrize("R", [32, 0])
def test_stream_k_compiles_with_its_fixup(R):
    "The stream-K kernel: the solver's storage, the same wgmmas, and its fixup's release add, poll and 128 relaxed loads of a partial."
    rep = jit.compile_kernel(HopperPgStreamKConfig(), pg_problem(4352, 3072, 3840, R))
    assert rep.smem_bytes == rep.budget.allocated
    ins = rep.instructions
    assert ins["wgmma (int8)"] == 16 and ins["wgmma (16-bit)"] == R // 16 and ins["local memory"] == 0, ins
    assert (rep.count(r"red\.release\.gpu\.global\.add\.s32"), rep.count(r"st\.relaxed\.gpu"), rep.count(r"nanosleep")) == (1, 1, 1)
    assert rep.count(r"ld\.relaxed\.gpu\.global\.s32") == 2 + 64 * 256 // 128      # the poll (twice) and a thread's partial


def test_stream_k_refuses_a_pair():
    with pytest.raises(ValueError, match="cluster_n=2"):
        smem.check_config(HopperPgStreamKConfig(cluster_n=2))


def test_the_decode_multiplies_nothing():
    """The register decode is table lookups (`prmt`) and logic: no integer multiply of weights by u in the PTX (on the
    H200 those cost the INT8 tensor pipe throughput, chapter 9), and the lookup tables are the solver's term."""
    from w4a4_book import smem
    from w4a4_book.kernels.pg_decode import DECODE_LOOKUP
    assert configs.PG_LOOKUP_BYTES == DECODE_LOOKUP.nbytes
    for cfg in (HopperPgConfig(), HopperPgSmemConfig(), HopperPgV1Config()):
        rep = jit.compile_kernel(cfg, pg_problem(4352, 3072, 3840, 0))
        assert rep.count(r"mad\.hi\.u32") == 0 and rep.count(r"prmt\.b32") >= 5, type(cfg).__name__


@pytest.mark.parametrize("cls, kw", [(HopperPgConfig, dict(lora_chunk=32, lora_stages=2)),
                                     (HopperPgConfig, dict(lora_chunk=32, lora_stages=2, cluster_n=2, lora_accounting="pair")),
                                     (HopperPgSmemConfig, dict(lora_chunk=32, lora_stages=2))])
def test_lora_chunks_compile_with_the_solvers_storage(cls, kw):
    """The LoRA blocks streamed `lora_chunk` rank columns at a time: the struct is the solver's, each chunk is
    `lora_chunk / 16` LoRA wgmmas (R / 16 in all), and at R = 128 the 256-row tile keeps more main stages than with
    the rank held whole."""
    cfg, p = cls(**kw), pg_problem(4352, 3072, 3840, 128)
    rep = jit.compile_kernel(cfg, p)
    check_compiled(rep, 128, a_in_registers=cls is HopperPgConfig)
    whole = smem.solve(replace(cfg, lora_chunk=None, lora_stages=1), p).stages["main"]
    assert rep.budget.stages["main"] > whole


def test_lora_chunk_validity():
    R128, R16 = smem.ProblemSpec(R=128), smem.ProblemSpec(R=16)
    with pytest.raises(ValueError, match="lora_chunk=48: must divide the rank R=128"):
        smem.solve(HopperPgConfig(lora_chunk=48), R128)
    with pytest.raises(ValueError, match="lora_chunk=32: v1 loads"):
        smem.solve(HopperPgV1Config(lora_chunk=32), R128)
    with pytest.raises(ValueError, match="lora_chunk=8"):
        HopperPgConfig(lora_chunk=8)                                        # refused when made
    smem.solve(HopperPgConfig(lora_chunk=32), R16)                          # wider than the rank: one chunk
    assert configs.lora_chunk_of(HopperPgConfig(lora_chunk=32), 16) == 16

def check_vectors(rep):
    """With the epilogue's vectors in shared memory the kernel loads only each thread's few shares from global memory
    (before the K-loop); read from global, the epilogue loads base_a once per activation row it holds."""
    loads = rep.count(r"ld\.global")
    assert (loads <= 8) if rep.config.epi_vectors == "smem" else (loads > 8), (rep.config.epi_vectors, loads)


def check_compiled(rep, R, a_in_registers):
    assert rep.smem_bytes == rep.budget.allocated
    ins = rep.instructions
    n = 16 if a_in_registers else 8                     # PTX copies of the K-block's four wgmmas (peeled blocks)
    assert ins["wgmma (int8)"] == n and ins["wgmma (16-bit)"] == R // 16 and ins["local memory"] == 0
    assert rep.count(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.satfinite\.s32\.s8\.s8 \{[^}]*\}, \{%r") == (n if a_in_registers else 0)
    res = rep.ptxas()
    if res is None:
        pytest.skip("no ptxas on this machine")
    assert res["wgmma_advisories"] == [] and res["spill_stores"] == 0, res


def test_requirements_and_bad_input():
    a = quantize(torch.randn(64, 256), "int4_pg")
    w = quantize(torch.randn(256, 256), "int4_pg")
    kernel = registry.spec_for(HopperPgConfig()).kernel_class()
    with pytest.raises(ValueError, match="act: the exact-integer kernel reads int8 activations"):
        kernel.tensors(Problem(64, 256, 256, 0, scale_dtype=torch.uint8, fmt="int4_pg"), a, w, None, None, None, None, None)
    with pytest.raises(ValueError, match="act: must be on a CUDA device"):
        gemm.gemm_w4a4(a.as_int8(), w, config=HopperPgConfig())
    with pytest.raises(ValueError, match="wgt: N=192 must be a multiple of 128"):
        jit.check(HopperPgConfig(), pg_problem(64, 192, 256))
    with pytest.raises(ValueError, match="K=149248 is too long for an exact int32 sum"):
        from w4a4_book.operands import check_int32_sum
        check_int32_sum(149248, "int4_pg", "int4_pg")
    with pytest.raises(ValueError, match="R=256"):
        jit.build(HopperPgConfig(), pg_problem(4352, 3072, 3840, 256))       # the 256-row tile leaves no room at R = 256


# ---------------------------------------------------------------- GPU
def make_pg_case(M, N, K, R, out_dtype=torch.bfloat16, affine=True, act_fmt="int4_pg", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g)
    x[:, 7] *= 30                                                      # an outlier channel
    act = quantize(x, act_fmt)
    act = act.as_int8() if act_fmt == "int4_pg" else act
    wgt = quantize(torch.randn(N, K, device="cuda", generator=g), "int4_pg")
    la = lu = wcs = bias = None
    if R:
        la = torch.randn(M, R, device="cuda", generator=g).to(out_dtype)
        lu = (0.1 * torch.randn(N, R, device="cuda", generator=g)).to(out_dtype)
    if affine:
        wcs = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).to(out_dtype)
        bias = torch.randn(N, device="cuda", generator=g).to(out_dtype)
    return act, wgt, la, lu, wcs, bias


def check_exact(out, case, out_dtype):
    """Elementwise against the exact reference: the output's rounding (half an ulp: 2^-8 relative for bf16's 8-bit
    significand, 2^-11 for fp16) plus the fp32 arithmetic before it (the int32 sum converted and scaled, the LoRA
    products summed, the affine: a few roundings of 2^-24 each of the terms' magnitudes, 2^-20 leaves room)."""
    act, wgt, la, lu, wcs, bias = case
    ref = w4a4_gemm_exact(*case)
    mag = w4a4_gemm_exact(act, wgt).abs()
    if la is not None:
        mag = mag + la.double().abs() @ lu.double().abs().T
    if wcs is not None:
        mag = mag * wcs.double().abs()
    half_ulp = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -11
    y = out.double()
    assert not torch.isnan(y).any(), "unwritten or NaN outputs"
    bound = half_ulp * ref.abs() + 2.0 ** -20 * mag + 2.0 ** -30
    worst = ((y - ref).abs() / bound).max().item()
    assert worst <= 1.0, f"max err/bound {worst:.3f}"


GRID = [  # M (tails, several tiles per CTA), N, K, R, out dtype, affine, cluster_n, tile_m, where the epilogue's vectors live
    (128, 128, 128, 16, torch.bfloat16, True, 1, 256, "smem"),
    (300, 512, 1024, 128, torch.bfloat16, True, 1, 256, "smem"),
    (300, 512, 1024, 128, torch.bfloat16, True, 1, 256, "global"),
    (777, 3840, 1536, 64, torch.float16, True, 1, 256, "smem"),
    (1000, 1024, 3840, 32, torch.bfloat16, False, 1, 256, "smem"),
    (4352, 3072, 3840, 32, torch.bfloat16, True, 1, 256, "smem"),
    (4352, 3072, 3840, 32, torch.bfloat16, True, 1, 256, "global"),
    (257, 2048, 640, 0, torch.float16, False, 1, 256, "smem"),
    (513, 3072, 2048, 128, torch.bfloat16, True, 2, 256, "smem"),
    (64, 256, 256, 16, torch.float16, True, 2, 256, "global"),
    (2000, 1024, 1024, 256, torch.bfloat16, True, 1, 128, "smem"),
    (4352, 3072, 3840, 32, torch.bfloat16, True, 2, 128, "smem"),
    (256, 3072, 3840, 32, torch.bfloat16, True, 1, 64, "smem"),     # the small-M tile
    (300, 512, 1024, 128, torch.float16, True, 2, 64, "smem"),
    (4352, 3072, 3840, 32, torch.bfloat16, True, 1, 224, "smem"),   # the wave-fitting tiles (`heuristics.tile_choice`)
    (1000, 3072, 3840, 128, torch.float16, True, 2, 224, "global"),
    (777, 3840, 1536, 0, torch.bfloat16, False, 1, 192, "smem"),
    (300, 512, 1024, 64, torch.bfloat16, True, 1, 160, "smem"),
    (4352, 3072, 3840, 32, torch.bfloat16, True, 1, 208, "smem"),   # 16-row output sub-tiles (tile heights of 16·odd)
    (1000, 3072, 3840, 128, torch.float16, True, 2, 208, "global"),
    (300, 512, 1024, 64, torch.bfloat16, True, 1, 144, "smem"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, R, out_dtype, affine, cluster_n, tile_m, vectors", GRID)
def test_matches_exact_reference(M, N, K, R, out_dtype, affine, cluster_n, tile_m, vectors):
    case = make_pg_case(M, N, K, R, out_dtype, affine, seed=M + N + K + R)
    out = torch.full((M, N), float("nan"), dtype=out_dtype, device="cuda")
    cfg = HopperPgConfig(cluster_n=cluster_n, tile_m=tile_m, epi_tile_m=32 if tile_m % 32 == 0 else 16, epi_vectors=vectors)
    gemm.gemm_w4a4(*case, out_dtype=out_dtype, config=cfg, out=out)
    torch.cuda.synchronize()
    check_exact(out, case, out_dtype)


LORA_CHUNK_GRID = [  # M, N, K, R, cluster_n, lora_chunk, lora_stages: the rank streamed through a LoRA ring in chunks
    (300, 512, 1024, 128, 1, 32, 2), (513, 3072, 2048, 128, 2, 32, 2), (777, 3840, 1536, 64, 1, 16, 3),
    (4352, 3072, 3840, 256, 1, 64, 2), (128, 128, 128, 16, 1, 32, 2)]     # the last: a chunk wider than the rank


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, R, cluster_n, chunk, lstages", LORA_CHUNK_GRID)
def test_lora_chunks_match_exact_reference(M, N, K, R, cluster_n, chunk, lstages):
    case = make_pg_case(M, N, K, R, seed=M + R + chunk)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = HopperPgConfig(cluster_n=cluster_n, lora_chunk=chunk, lora_stages=lstages, epi_vectors="smem")
    gemm.gemm_w4a4(*case, config=cfg, out=out)
    torch.cuda.synchronize()
    check_exact(out, case, torch.bfloat16)

@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, R, cluster_n, vectors", [(300, 512, 1024, 128, 1, "global"), (4352, 3072, 3840, 32, 2, "smem"),
                                                    (777, 3840, 1536, 0, 1, "smem")])
def test_decode_warpgroup_variant_matches_exact_reference(M, N, K, R, cluster_n, vectors):
    case = make_pg_case(M, N, K, R, seed=M + K)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm.gemm_w4a4(*case, config=HopperPgSmemConfig(cluster_n=cluster_n, epi_vectors=vectors), out=out)
    torch.cuda.synchronize()
    check_exact(out, case, torch.bfloat16)


V1_GRID = [  # M, N, K, R, cluster_n, tile_m, vectors: K = 256 has fewer K-blocks than stages (no refill at all)
    (300, 512, 1024, 128, 1, 256, "global"), (777, 3840, 256, 32, 1, 128, "smem"), (513, 3072, 2048, 64, 2, 128, "global"),
    (4352, 3072, 3840, 128, 2, 128, "global"), (257, 2048, 640, 0, 1, 256, "smem")]


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, R, cluster_n, tile_m, vectors", V1_GRID)
def test_v1_matches_exact_reference(M, N, K, R, cluster_n, tile_m, vectors):
    case = make_pg_case(M, N, K, R, seed=M + N + R)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm.gemm_w4a4(*case, config=HopperPgV1Config(cluster_n=cluster_n, tile_m=tile_m, epi_vectors=vectors), out=out)
    torch.cuda.synchronize()
    check_exact(out, case, torch.bfloat16)


@pytest.mark.gpu
def test_v1_two_stages_and_several_m_through_one_kernel():
    cfg = HopperPgV1Config(stages=2, tile_m=128)             # two stages: every refill lands in the stage the next block waits on
    before = len(jit._compiled)
    for M in (1, 300, 4352):
        case = make_pg_case(M, 512, 2048, 32, seed=M)
        out = gemm.gemm_w4a4(*case, config=cfg)
        torch.cuda.synchronize()
        check_exact(out, case, torch.bfloat16)
    assert len(jit._compiled) - before == 1


def test_deferred_store_is_refused_where_it_has_no_place():
    "Only the register-decode kernel on whole tiles holds a tile's output; its variants refuse `epi_deferred` by name."
    for cls in (HopperPgV1Config, HopperPgStreamKConfig, HopperPgSmemConfig):
        with pytest.raises(ValueError, match="^epi_deferred"):
            smem.check_config(cls(epi_deferred=True))


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, R, tile_m, cluster_n", [(4352, 3072, 3840, 32, 208, 1), (300, 512, 1024, 64, 224, 1),
                                                          (300, 512, 128, 16, 64, 1), (513, 3072, 256, 0, 208, 2),
                                                          (64, 256, 256, 16, 64, 1)])
def test_deferred_store_matches_exact_reference(M, N, K, R, tile_m, cluster_n):
    "`epi_deferred`: each tile stored during the next one's first block, the last after the loop; one K-block, one tile a CTA and a pair included."
    case = make_pg_case(M, N, K, R, torch.bfloat16, True, seed=M + K)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = HopperPgConfig(tile_m=tile_m, epi_tile_m=32 if tile_m % 32 == 0 else 16, cluster_n=cluster_n, epi_deferred=True, epi_vectors="smem")
    gemm.gemm_w4a4(*case, config=cfg, out=out)
    torch.cuda.synchronize()
    check_exact(out, case, torch.bfloat16)
    again = gemm.gemm_w4a4(*case, config=replace(cfg, epi_deferred=False))
    assert torch.equal(out, again), "holding a tile changes when it is stored, not what"


@pytest.mark.gpu
def test_w4a8_activations():
    case = make_pg_case(300, 512, 1024, 32, act_fmt="int8", seed=3)
    out = gemm.gemm_w4a4(*case, config=HopperPgConfig())
    torch.cuda.synchronize()
    check_exact(out, case, torch.bfloat16)


@pytest.mark.gpu
def test_one_compiled_kernel_serves_every_m():
    cfg = HopperPgConfig(epi_tile_m=64, epi_vectors="smem")   # a config no other test compiles; M tails clamp base_a
    before = len(jit._compiled)
    for M in (1, 17, 256, 300, 4352):
        case = make_pg_case(M, 512, 1024, 32, seed=M)
        out = gemm.gemm_w4a4(*case, config=cfg)
        torch.cuda.synchronize()
        check_exact(out, case, torch.bfloat16)
    assert len(jit._compiled) - before == 1


SK_GRID = [  # M, N, K, R: 256-row tiles on 132 CTAs; whole rounds, a cut last round, fewer tiles than CTAs, one K-block a run's piece
    (4352, 3072, 3840, 32), (2176, 3072, 3840, 0), (4352, 3840, 15360, 32), (4352, 3072, 384, 16), (1000, 1024, 3840, 32),
    (4352, 15360, 3840, 32), (300, 512, 1024, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, R", SK_GRID)
def test_stream_k_equals_whole_tiles(M, N, K, R):
    """The stream-K kernel's output is the whole-tile kernel's (256-row tiles) bit for bit, on the first call, a
    second one (its flags were reset) and three CUDA-graph replays."""
    from w4a4_book.bench.timing import cuda_graph
    case = make_pg_case(M, N, K, R, seed=M + N + K)
    want = gemm.gemm_w4a4(*case, config=HopperPgConfig(tile_m=256, epi_vectors="smem"))
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    run = lambda: gemm.gemm_w4a4(*case, config=HopperPgStreamKConfig(), out=out)
    for _ in range(2):
        out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        assert torch.equal(out, want), (out.float() - want.float()).abs().max().item()
    replay = cuda_graph(run)
    for _ in range(3):
        out.fill_(float("nan"))
        replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    check_exact(out, case, torch.bfloat16)


def test_stream_k_tensors_are_views_of_the_zeroed_stream_workspace(monkeypatch):
    """Stream-K's partials and flags come from this thread's and stream's own zeroed workspace, kept between calls;
    under a CUDA-graph capture (pretended on the CPU), from a new zeroed buffer that is not kept."""
    from w4a4_book import cache
    from w4a4_book.kernels.sm90_pg import SK_WORDS, sk_tensors
    cpu = torch.device("cpu")
    partials, flags = sk_tensors(cpu, 2)
    assert (partials.numel(), flags.numel(), int(flags.abs().sum())) == (2 * SK_WORDS, 4, 0)
    assert sk_tensors(cpu, 2)[1].data_ptr() == flags.data_ptr()
    assert [t.numel() for t in sk_tensors(cpu, 0)] == [1, 1]
    monkeypatch.setattr(cache, "capturing", lambda dev: True)
    captured = sk_tensors(cpu, 2)[1]
    assert captured.data_ptr() != flags.data_ptr() and int(captured.abs().sum()) == 0
    monkeypatch.undo()
    assert sk_tensors(cpu, 2)[1].data_ptr() == flags.data_ptr()
