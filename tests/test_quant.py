"The fused activation kernel: argument checks and PTX on any machine, exactness against `quantize` on an sm_90 GPU."
import re

import pytest
import torch

from w4a4_book import act_quant, cache, heuristics, jit
from w4a4_book.operands import check_quant_inputs
from w4a4_book.kernels.sm90_quant import G, MAX_RANK, VEC, QuantLoraDown, RowCodes
from w4a4_book.formats import quantize, reciprocal


def bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("kw, msg", [
    (dict(x=bf16(64, 512).float()), "x: must be bfloat16 or float16"),
    (dict(x=bf16(64, 96)), "x: K=96 must be a multiple of the int4 group size 64"),
    (dict(x=bf16(0, 512)), "x: has no rows"),
    (dict(x=bf16(64, 512).t()), "x: must be 2-D|x: must be contiguous|K=64"),
    (dict(x=bf16(64, 512), smooth=bf16(512).half()), "smooth: dtype"),
    (dict(x=bf16(64, 512), smooth=bf16(256)), "smooth: expected shape \\[512\\]"),
    (dict(x=bf16(64, 512), lora_down_t=bf16(512, 32)), "lora_down_t: expected shape \\[R, 512\\]"),
    (dict(x=bf16(64, 512), lora_down_t=bf16(272, 512)), "rank R=272"),
    (dict(x=bf16(64, 512), lora_down_t=bf16(32, 512).half()), "lora_down_t: dtype"),
])
def test_bad_arguments_are_named(kw, msg):
    with pytest.raises((TypeError, ValueError), match=msg):
        check_quant_inputs(**kw, group_size=G, max_rank=MAX_RANK, device=False)


def test_cpu_tensors_are_refused_before_any_launch():
    with pytest.raises(ValueError, match="x: must be on a CUDA device"):
        act_quant.quantize_lora_down(bf16(64, 512))


@pytest.mark.parametrize("R", [0, 32, 128])
def test_compiles_for_sm90a_with_exact_arithmetic(R):
    ptx, _ = act_quant.compile_quant(M=300, K=1024, R=R)
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == (4 if R else 0)
    assert len(re.findall(r"cvt\.rni\.s32\.f32", ptx)) == 32 and not re.search(r"div\.approx", ptx)
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == (4 if R else 2)


CASES = [  # M (tails), K, R, dtype, smooth
    (64, 128, 16, torch.bfloat16, True),
    (300, 512, 32, torch.bfloat16, True),
    (777, 1536, 64, torch.float16, True),
    (777, 1536, 0, torch.float16, True),
    (777, 1536, 64, torch.bfloat16, True),
    (4352, 3840, 128, torch.bfloat16, True),
    (1000, 1024, 256, torch.bfloat16, False),
    (257, 640, 0, torch.float16, True),
    (256, 15360, 32, torch.bfloat16, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("M, K, R, dt, smooth", CASES)
def test_exact_against_quantize(M, K, R, dt, smooth):
    g = torch.Generator(device="cuda").manual_seed(M + K + R)
    x = (torch.randn(M, K, device="cuda", generator=g) * 3).to(dt)
    x[:, 5] *= 40                                                    # an outlier channel
    lam = (torch.rand(K, device="cuda", generator=g) + 0.5).to(dt) if smooth else None
    down = (torch.randn(K, R, device="cuda", generator=g) / K ** 0.5).to(dt) if R else None
    act, lora_act = act_quant.quantize_lora_down(x, lam, down.T.contiguous() if R else None)
    torch.cuda.synchronize()
    xs = x.float() * reciprocal(lam.float()) if smooth else x.float()
    ref = quantize(xs, "int4", dt)
    bad = (act.scales != ref.scales).nonzero()
    assert not len(bad), (f"{len(bad)} scales differ, first (group, row): {bad[:4].tolist()}, "
                          f"kernel {act.scales[tuple(bad[0])].item()} vs {ref.scales[tuple(bad[0])].item()}")
    bad = (act.data != ref.data).nonzero()
    assert not len(bad), f"{len(bad)} code bytes differ, first (row, byte): {bad[:4].tolist()}"
    if R:
        want = x.float() @ down.float()
        # fp32 sums in another order, then one rounding to the 16-bit output: within one output ulp + a little
        ulp = 2.0 ** -7 if dt == torch.bfloat16 else 2.0 ** -10
        bound = ulp * want.abs() + 2.0 ** -16 * want.abs().max()
        assert ((lora_act.float() - want).abs() <= bound).all()
    else:
        assert lora_act is None


def test_k_splits_fill_the_gpu():
    """Enough shares of K for `ctas_per_sm` CTAs per SM (default four), each share a whole number of K-blocks, and no
    fewer than four K-blocks a share while one CTA an SM remains; one share when rows suffice."""
    assert heuristics.k_splits(68, 60, 132, 2) == 4     # M=4352, two CTAs per SM: 272 CTAs
    assert heuristics.k_splits(68, 60, 132) == 10       # the default, four per SM: 680 CTAs
    assert heuristics.k_splits(4, 240, 132, 2) == 60    # M=256, K=15360: 66 wanted, but shares of at least 4 K-blocks: 60
    assert heuristics.k_splits(4, 160, 132) == 40       # M=256, K=10240: 132 wanted, 40 shares of 4 K-blocks (160 CTAs)
    assert heuristics.k_splits(4, 60, 132) == 60        # M=256, K=3840: 15 shares would leave SMs idle; 33 wanted, 60 divides
    assert heuristics.k_splits(16, 60, 132) == 15       # M=1024, K=3840: 33 wanted, 15 shares of 4 K-blocks (240 CTAs)
    assert heuristics.k_splits(1, 2, 132, 2) == 2       # K shorter than wanted: every K-block its own CTA
    assert heuristics.k_splits(300, 60, 132, 2) == 1
    assert heuristics.k_splits(300, 60, 132) == 2       # 300 row tiles, four CTAs per SM wanted: 2 shares


def int8_lane_case(M, K, R, dt, smooth, seed):
    "Seeded GPU inputs of the int8-lane activation tests: `(x, smooth, lora_down)`, with an outlier channel and an all-zero row."
    g = torch.Generator(device="cuda").manual_seed(M + K + R + seed)
    x = (torch.randn(M, K, device="cuda", generator=g) * 3).to(dt)
    x[:, 5] *= 40                                                    # an outlier channel
    x[min(3, M - 1)] = 0                                             # an all-zero row: base 0, u 1, codes 0
    lam = (torch.rand(K, device="cuda", generator=g) + 0.5).to(dt) if smooth else None
    down = (torch.randn(K, R, device="cuda", generator=g) / K ** 0.5).to(dt) if R else None
    return x, lam, down


def check_int8_lanes(codes, base, lora_act, x, lam, down, fmt):
    "`codes` and `base` are `quantize(x / smooth, fmt)`'s bit for bit; `lora_act` is `x @ lora_down` to its rounding."
    torch.cuda.synchronize()
    xs = x.float() * reciprocal(lam.float()) if lam is not None else x.float()
    ref = quantize(xs, fmt)
    ref8 = ref.as_int8() if fmt == "int4_pg" else ref
    bad = (base != ref8.base).nonzero()
    assert not len(bad), f"{len(bad)} bases differ, first rows {bad[:4].flatten().tolist()}"
    bad = (codes != ref8.data).nonzero()
    assert not len(bad), f"{len(bad)} codes differ, first (row, k): {bad[:4].tolist()}"
    assert (lora_act is None) == (down is None)
    if down is not None:
        want = x.float() @ down.float()
        ulp = 2.0 ** -7 if x.dtype == torch.bfloat16 else 2.0 ** -10
        assert ((lora_act.float() - want).abs() <= ulp * want.abs() + 2.0 ** -16 * want.abs().max()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_pg", "int8"])
@pytest.mark.parametrize("M, K, R, dt, smooth", CASES)
def test_int8_lanes_exact_against_quantize(fmt, M, K, R, dt, smooth):
    "The two-pass activation kernel writes `quantize(x / smooth, fmt)` bit for bit: the int8 lanes and every row's base."
    x, lam, down = int8_lane_case(M, K, R, dt, smooth, 1)
    act, lora_act = act_quant.quantize_lora_down(x, lam, down.T.contiguous() if R else None, fmt=fmt)
    assert act.fmt == fmt and act.packing == "int8"
    check_int8_lanes(act.data, act.base, lora_act, x, lam, down, fmt)


@pytest.mark.gpu
def test_int4_pg_exact_where_u_is_divided():
    """int4_pg on the layer's shape, with groups whose `q = (amax / 7) / base` lies within `FAST_U_MARGIN` of a half
    (the second pass divides there, `group_u`) and groups past it (it multiplies): bit for bit `quantize`'s codes."""
    from w4a4_book.kernels.sm90_quant import FAST_U_MARGIN
    x, lam, down = int8_lane_case(4352, 3840, 32, torch.bfloat16, True, 2)
    act, lora_act = act_quant.quantize_lora_down(x, lam, down.T.contiguous(), fmt="int4_pg")
    xs = x.float() * reciprocal(lam.float())
    amax = xs.abs().view(4352, -1, G).amax(-1)
    q = (amax / 7) / act.base[:, None].clamp_min(torch.finfo(torch.float32).tiny)
    divided = ((q - q.round()).abs() > 0.5 - FAST_U_MARGIN).sum().item()
    assert 0 < divided < q.numel(), divided
    check_int8_lanes(act.data, act.base, lora_act, x, lam, down, "int4_pg")


@pytest.mark.parametrize("mode", ["pg_rowmax", "int4_pg", "int8"])
def test_int8_lane_passes_compile_with_exact_arithmetic(mode):
    "The first pass (QuantLoraDown, pg_rowmax) and the second (RowCodes, per format): exact rounding, 16-byte loads."
    ptx, _ = act_quant.compile_quant(M=300, K=1024, R=32, mode=mode)
    assert not re.search(r"div\.approx", ptx)
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == (4 if mode == "pg_rowmax" else 0)   # the LoRA product rides the first pass
    # int4_pg: u by two multiplies and ROUNDER a trip (one lane of a group's eight computes each), the divisions and their one
    # conversion only on the branch near a half (group_u); values round in float32
    assert len(re.findall(r"cvt\.rni\.s32\.f32", ptx)) == {"pg_rowmax": 0, "int4_pg": 1, "int8": 0}[mode]
    # row_base (2 or 1), row_scales' 1/base and 1/(base·u) (one for int8, the same), group_u's branch (2)
    assert len(re.findall(r"div\.rn\.f32", ptx)) == {"pg_rowmax": 0, "int4_pg": 6, "int8": 2}[mode]
    if mode != "pg_rowmax":    # per value: v·r + ROUNDER, and q·u from its bits by one mul.lo (int4_pg) or none; per four values: three prmt
        assert len(re.findall(r"0f4B400000", ptx)) == VEC * RowCodes.unroll + (mode == "int4_pg")   # + group_u's rounding
        assert len(re.findall(r"mul\.lo\.s32", ptx)) == (VEC * RowCodes.unroll if mode == "int4_pg" else 0) + 2   # + a piece's trips
        assert len(re.findall(r"prmt\.b32", ptx)) == 3 * VEC // 4 * RowCodes.unroll
    # x from shared memory in four 16-byte loads and 1/smooth in eight, the share's 1/smooth staged there in one global
    # load; or x, 1/smooth and the LoRA partials from global
    assert len(re.findall(r"ld\.shared\.v4", ptx)) == (12 if mode == "pg_rowmax" else 0)
    assert len(re.findall(r"ld\.global\.v4", ptx)) == (1 if mode == "pg_rowmax" else RowCodes.unroll * 4 + 2)   # x, x ahead, 1/smooth (two), partials


@pytest.mark.parametrize("K", [1024, 3840, 10240, 15360])
@pytest.mark.parametrize("M", [1, 256, 300, 1024, 4352, 16384])
def test_row_codes_pieces_cover_each_row_once(M, K):
    "`RowCodes.per_row` (the kernel computes the same from the run-time M): the pieces cut each row's trips in runs, none empty, none longer than `MAX_TRIPS`, and give `WARPS` code warps unless a row has no more trips to cut."
    k = RowCodes("int4_pg")
    trips, n = k.trips(K), k.per_row(M, K)
    runs = [range(p * trips // n, (p + 1) * trips // n) for p in range(n)]      # as `codes` cuts them
    assert [t for r in runs for t in r] == list(range(trips)) and all(len(r) for r in runs)
    assert max(map(len, runs)) <= k.MAX_TRIPS
    assert M * n >= k.WARPS or n == trips
    assert n == 1 or M * (n - 1) < k.WARPS or -(-trips // (n - 1)) > k.MAX_TRIPS   # no more pieces than either bound asks


def test_row_codes_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="fmt='int4'"):
        RowCodes("int4")
    with pytest.raises(ValueError, match="mode: 'pg_quant'"):
        act_quant.compile_quant(mode="pg_quant")


def test_activation_formats_are_checked():
    with pytest.raises(ValueError, match="fmt: 'nvfp4': the activation kernel writes one of"):
        act_quant.quantize_lora_down(bf16(64, 512), fmt="nvfp4")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4", "int4_pg", "int8"])
def test_one_compiled_kernel_per_pass_serves_every_m(fmt):
    "The activation kernels read M at run time: M = 1, 17, 256 and 1024 share one compilation per pass, each exact."
    K, R, dev = 512, 32, torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cuda").manual_seed(7)
    lam = (torch.rand(K, device="cuda", generator=g) + 0.5).bfloat16()
    ldt = (torch.randn(R, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    sig = (K, R, torch.bfloat16, True, heuristics.ACT_STAGES, K // G)                  # the compile keys of this test's passes
    mine = lambda: [k for k in jit._compiled if k[0][1:] == sig and k[1] == dev.index]
    for key in mine():                                                               # compiled afresh here, whatever ran before
        del jit._compiled[key]
    for M in (1, 17, 256, 1024):
        assert act_quant.activation_k_splits(M, K, cache.sm_count(dev.index)) == K // G   # one share count for all four
        x = (torch.randn(M, K, device="cuda", generator=g) * 3).bfloat16()
        act, lora_act = act_quant.quantize_lora_down(x, lam, ldt, fmt=fmt)
        ref = quantize(x.float() * reciprocal(lam.float()), fmt, torch.bfloat16 if fmt == "int4" else None)
        ref = ref.as_int8() if fmt == "int4_pg" else ref
        assert torch.equal(act.data, ref.data), M
        assert torch.equal(act.scales, ref.scales) if fmt == "int4" else torch.equal(act.base, ref.base), M
        want = x.float() @ ldt.float().T
        assert ((lora_act.float() - want).abs() <= 2.0 ** -7 * want.abs() + 2.0 ** -16 * want.abs().max()).all(), M
    assert len(mine()) == (1 if fmt == "int4" else 2)                                # once per pass, for every M


ONE_PASS_CASES = [  # M (tails included), K, R, dtype, smooth, cluster
    (1, 1024, 32, torch.bfloat16, True, 2), (300, 1024, 128, torch.bfloat16, True, 4), (257, 3840, 0, torch.float16, False, 6),
    (4352, 3840, 32, torch.bfloat16, True, None), (1000, 1024, 256, torch.bfloat16, True, 8), (513, 15360, 32, torch.bfloat16, True, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_pg", "int8"])
@pytest.mark.parametrize("M, K, R, dt, smooth, cluster", ONE_PASS_CASES)
def test_one_pass_exact_against_quantize(fmt, M, K, R, dt, smooth, cluster):
    "The one-pass kernel (a cluster per row tile) writes `quantize(x / smooth, fmt)` bit for bit, and lora_act to its rounding."
    x, lam, down = int8_lane_case(M, K, R, dt, smooth, 2)
    ldt = down.T.contiguous() if R else None
    codes, base, lora_act = act_quant.quantize_rows_one_pass(x, lam, ldt, fmt=fmt, cluster=cluster)
    check_int8_lanes(codes, base, lora_act, x, lam, down, fmt)
    if R:
        again = act_quant.quantize_rows_one_pass(x, lam, ldt, fmt=fmt, cluster=cluster)[2]
        assert torch.equal(again, lora_act)                          # a fixed order of summation: the same every run


def test_one_pass_smem_is_the_kernels_and_bad_clusters_are_refused():
    "`one_pass_smem` is the kernel's storage, byte for byte; a cluster that cannot hold its shares is refused before a launch."
    for K, R, c, fmt in [(3840, 32, 6, "int4_pg"), (3840, 0, 4, "int8"), (1024, 128, 2, "int4_pg")]:
        ptx, smem = act_quant.compile_quant(M=300, K=K, R=R, k_splits=c, mode=f"one_pass_{fmt}")
        assert "mapa.shared::cluster" in ptx and "barrier.cluster.arrive" in ptx and not re.search(r"div\.approx", ptx)
        assert smem == act_quant.one_pass_smem(K, R, c), (K, R, c, smem)
    assert (act_quant.one_pass_cluster(3840, 32), act_quant.one_pass_cluster(15360, 32), act_quant.one_pass_cluster(10240, 128)) == (4, 15, None)
    assert act_quant.compile_quant(M=4352, K=3840, R=32, k_splits=10, mode="pg_rowmax")[1] == 52224   # two passes: no cluster, no maxima
    with pytest.raises(ValueError, match="one pass holds all K/64=60 K-blocks"):
        act_quant.compile_quant(M=4352, K=3840, R=32, k_splits=10, mode="pg_rowmax") and QuantLoraDown(32, 5, True, 10, mode="int4_pg").make_storage(None, None, None, 3840)
    x = bf16(64, 3840)
    for bad in (7, 1, 32, 2):                                        # 7 ∤ 60; 1 and 32 outside [2, 16]; 2: 30 K-blocks do not fit
        with pytest.raises(ValueError, match="cluster: "):
            act_quant.quantize_rows_one_pass(x, fmt="int4_pg", cluster=bad)
    with pytest.raises(ValueError, match="fmt: 'int4': one pass writes int4_pg or int8"):
        act_quant.quantize_rows_one_pass(x, fmt="int4")
