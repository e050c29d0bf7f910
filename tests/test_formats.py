"Bit-exact and property-based tests of the 4-bit formats in `w4a4_book.formats`."
import pytest
import torch
from hypothesis import given, settings, strategies as st

from w4a4_book.formats import INT_RANGE_LIMIT
from w4a4_book.formats import (GROUP_SIZE, QTensor, decode_table, dequantize, pack_nibbles, quantize,
                               unpack_int4, unpack_nibbles, _round_e2m1)

INT4_VALUES = [0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1]
E2M1_VALUES = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
ALL_CODES = torch.arange(16, dtype=torch.uint8)


def unit_qtensor(fmt, scale_dtype=None):
    "One row holding every code in order, repeated over one group, with all scales 1."
    G = GROUP_SIZE[fmt]
    codes = ALL_CODES.repeat(G // 16)[None]
    if fmt == "int4":
        return QTensor(pack_nibbles(codes), torch.ones(1, 1, dtype=scale_dtype), fmt)
    return QTensor(pack_nibbles(codes), torch.ones(1, 1).to(torch.float8_e4m3fn), fmt, torch.tensor(1.0))


def test_decode_table_literals():
    assert decode_table("int4").tolist() == INT4_VALUES
    assert decode_table("nvfp4").tolist() == E2M1_VALUES
    assert torch.signbit(decode_table("nvfp4")).tolist() == [c >= 8 for c in range(16)]


@pytest.mark.parametrize("fmt,scale_dtype", [("int4", torch.float16), ("int4", torch.bfloat16), ("nvfp4", None)])
def test_every_code_decodes(fmt, scale_dtype):
    q = unit_qtensor(fmt, scale_dtype)
    expected = (INT4_VALUES if fmt == "int4" else E2M1_VALUES) * (GROUP_SIZE[fmt] // 16)
    out = dequantize(q)
    assert out.dtype == torch.float32 and out.shape == (1, GROUP_SIZE[fmt])
    assert out[0].tolist() == expected
    if fmt == "nvfp4":
        assert torch.signbit(out[0, 8]) and out[0, 8] == 0


def test_packing_layout():
    codes = torch.tensor([[0x3, 0xA, 0xF, 0x0]], dtype=torch.uint8)
    data = pack_nibbles(codes)
    assert data.tolist() == [[0xA3, 0x0F]]                 # low nibble = even k
    assert unpack_nibbles(data).tolist() == codes.tolist()
    assert unpack_int4(data).tolist() == [[3, -6, -1, 0]]
    assert unpack_int4(data).dtype == torch.int8


def test_pack_roundtrip_random():
    codes = torch.randint(0, 16, (7, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    data = pack_nibbles(codes)
    assert data.shape == (7, 128) and data.is_contiguous()
    assert torch.equal(unpack_nibbles(data), codes)
    assert torch.equal(unpack_int4(data).long(), decode_table("int4").long()[codes.long()])


def test_e2m1_rounding_ties_to_even_and_saturates():
    a = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 4.99, 6.0, 6.4, 1e9])
    assert decode_table("nvfp4")[_round_e2m1(a).long()].tolist() == [0, 1, 1, 2, 2, 4, 4, .5, 4, 6, 6, 6]


def test_zeros_and_negative_zero():
    x = torch.zeros(2, 64)
    x[1] = -0.0
    for fmt in GROUP_SIZE:
        q = quantize(x, fmt)
        out = dequantize(q)
        assert torch.equal(out, torch.zeros_like(out)) and not out.isnan().any()
        assert (q.scales.float() == 0).all()
    assert unpack_nibbles(quantize(x, "int4").data).unique().tolist() == [0]
    nib = unpack_nibbles(quantize(x, "nvfp4").data)
    assert nib[0].unique().tolist() == [0] and nib[1].unique().tolist() == [8]
    assert quantize(x, "nvfp4").global_scale.item() == 1.0


def test_all_equal_group_is_exact_at_full_scale():
    x = torch.full((1, 64), -2.5)
    q = quantize(x, "int4")
    assert unpack_int4(q.data).unique().tolist() == [-7]
    assert q.scales.item() == (torch.tensor(2.5) / 7).half().item()
    qf = quantize(x, "nvfp4")
    assert unpack_nibbles(qf.data).unique().tolist() == [0xF]          # -6
    assert torch.allclose(dequantize(qf), x, rtol=1e-6, atol=0)


def test_int4_never_emits_minus_eight():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(2)) * 10
    assert unpack_int4(quantize(x, "int4").data).min().item() == -7


# ---------------------------------------------------------------------------------------------
# The half-step bound on generated tensors

SPECIAL = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@st.composite
def int_matrices(draw):
    "`matrices` for the int8-lane formats: magnitudes below `INT_RANGE_LIMIT` (2^127), the range `quantize` accepts for them."
    x = draw(matrices("int4"))
    return torch.where(x.abs() >= INT_RANGE_LIMIT, torch.copysign(torch.tensor(2.0 ** 126), x), x)


@st.composite
def matrices(draw, fmt):
    "Random [rows, K] float32 with zero groups, all-equal groups, outliers, negative zeros and tiny groups."
    G = GROUP_SIZE[fmt]
    rows, ngroups = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    x = torch.randn(rows, ngroups * G, generator=gen) * 2.0 ** draw(st.integers(-40, 12))
    for kind in draw(st.lists(st.sampled_from(["zero", "equal", "outlier", "negzero", "tiny", "special"]), max_size=5)):
        r, g = draw(st.integers(0, rows - 1)), draw(st.integers(0, ngroups - 1))
        grp, k = slice(g * G, (g + 1) * G), g * G + draw(st.integers(0, G - 1))
        if kind == "zero": x[r, grp] = 0.0
        elif kind == "equal": x[r, grp] = draw(SPECIAL)
        elif kind == "outlier": x[r, k] *= 2.0 ** draw(st.integers(3, 20))
        elif kind == "negzero": x[r, grp] = torch.where(torch.rand(G, generator=gen) < 0.5, -0.0, x[r, grp])
        elif kind == "tiny": x[r, grp] *= 2.0 ** -draw(st.integers(10, 60))
        else: x[r, k] = draw(SPECIAL)
    return x


def group_view(t, G):
    return t.reshape(t.shape[0], -1, G)


def check_int4_bound(x, scale_dtype):
    G = GROUP_SIZE["int4"]
    raw = group_view(x, G).abs().amax(-1) / 7
    if torch.isinf(raw.to(scale_dtype)).any():
        with pytest.raises(ValueError, match="use bfloat16 scales"):
            quantize(x, "int4", scale_dtype)
        return
    q = quantize(x, "int4", scale_dtype)
    assert q.scales.dtype == scale_dtype
    err = group_view((x.double() - dequantize(q).double()).abs(), G)
    s = q.scales.double().T.unsqueeze(-1)
    amax = group_view(x.double().abs(), G).amax(-1, keepdim=True)
    # always: half a step (the reciprocal and the product each round once: a flipped rounding leaves |t - q| <=
    # 1/2 + 7.03 * 2^-23), or for a subnormal scale (the clamp at +-7, or a reciprocal saturated at FLT_MAX) at most amax
    assert (err <= torch.maximum(s / 2 * (1 + 2**-19), amax)).all()
    # groups with a normal scale: half a step, full stop
    normal = (s >= torch.finfo(scale_dtype).tiny).expand_as(err)
    assert (err[normal] <= (s * (0.5 + 2**-20)).expand_as(err)[normal]).all()


def check_nvfp4_bound(x):
    G = GROUP_SIZE["nvfp4"]
    q = quantize(x, "nvfp4")
    gs = q.global_scale.double()
    err = group_view((x.double() - dequantize(q).double()).abs(), G)
    S = q.scales.double().T.unsqueeze(-1) * gs
    ax = group_view(x.double().abs(), G)
    amax = ax.amax(-1, keepdim=True)
    t = torch.where(S > 0, ax / S, 0.0)
    h = torch.where(t < 2, 0.25, torch.where(t < 4, 0.5, 1.0))
    slack = ax * 2**-22 + 2**-140
    assert (err <= torch.maximum(S * h, amax - 6 * S) * (1 + 2**-20) + slack).all()
    normal = ((q.scales.float().T.unsqueeze(-1) >= 2**-6) & (S >= 2**-100)).expand_as(err)
    assert (err[normal] <= (S * h * (1 + 2**-20) + slack)[normal]).all()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_int4_half_step_bound_fp16(data):
    check_int4_bound(data.draw(matrices("int4")), torch.float16)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_int4_half_step_bound_bf16(data):
    check_int4_bound(data.draw(matrices("int4")), torch.bfloat16)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_nvfp4_half_local_step_bound(data):
    check_nvfp4_bound(data.draw(matrices("nvfp4")))


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("call,exc,msg", [
    (lambda x: quantize(x, "fp4"), ValueError, "fmt='fp4'"),
    (lambda x: quantize(x, None), TypeError, "fmt must be a str"),
    (lambda x: quantize(x.int(), "int4"), TypeError, "x must have dtype"),
    (lambda x: quantize(x.numpy(), "int4"), TypeError, "x must be a torch.Tensor"),
    (lambda x: quantize(x[:, :80], "int4"), ValueError, "not a multiple of the int4 group size 64"),
    (lambda x: quantize(x[:, :120], "nvfp4"), ValueError, "not a multiple of the nvfp4 group size 16"),
    (lambda x: quantize(x[None], "int4"), ValueError, "x must be 2-D"),
    (lambda x: quantize(x, "int4", torch.float32), ValueError, "scale_dtype"),
    (lambda x: quantize(x, "nvfp4", torch.bfloat16), ValueError, "scale_dtype"),
    (lambda x: quantize(x.masked_fill(x > 1, float("nan")), "nvfp4"), ValueError, "x must be finite"),
    (lambda x: dequantize(x), TypeError, "q must be a QTensor"),
    (lambda x: dequantize(quantize(x, "int4"), "nvfp4"), ValueError, "does not match q.fmt"),
    (lambda x: dequantize(quantize(x, "int4"), "int5"), ValueError, "fmt='int5'"),
])
def test_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call(torch.randn(3, 128))


def test_qtensor_validation():
    q = quantize(torch.randn(4, 128), "int4")
    f = quantize(torch.randn(4, 128), "nvfp4")
    bad = [
        (lambda: QTensor(q.data.T.contiguous().T, q.scales, "int4"), ValueError, "data must be contiguous"),
        (lambda: QTensor(q.data.to(torch.int8), q.scales, "int4"), TypeError, "data must be uint8"),
        (lambda: QTensor(q.data[:, :48].contiguous(), q.scales, "int4"), ValueError, "K=96 codes per row, not a multiple"),
        (lambda: QTensor(q.data, q.scales.T.contiguous(), "int4"), ValueError, "scales must have shape"),
        (lambda: QTensor(q.data, torch.ones(2, 8, dtype=torch.float16)[:, ::2], "int4"), ValueError,
         "scales must be contiguous"),
        (lambda: QTensor(q.data, q.scales.float(), "int4"), TypeError, "scales must have dtype"),
        (lambda: QTensor(q.data, q.scales, "int4", torch.tensor(1.0)), ValueError, "global_scale must be None"),
        (lambda: QTensor(f.data, f.scales, "nvfp4"), TypeError, "global_scale must be a 0-d float32"),
        (lambda: QTensor(f.data, f.scales, "nvfp4", torch.tensor([1.0])), TypeError, "global_scale must be a 0-d"),
        (lambda: QTensor(f.data, f.scales, "mxfp4", f.global_scale), ValueError, "fmt='mxfp4'"),
    ]
    for call, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            call()
    assert (q.rows, q.k, q.group_size, q.shape) == (4, 128, 64, (4, 128))
    assert (f.rows, f.k, f.group_size, f.shape) == (4, 128, 16, (4, 128))


def test_unpack_rejects_non_contiguous():
    data = torch.zeros(8, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="data must be contiguous"):
        unpack_int4(data.T)
    with pytest.raises(ValueError, match="codes must lie in 0..15"):
        pack_nibbles(torch.full((1, 2), 16, dtype=torch.uint8))


def test_empty_rows_and_to():
    for fmt in GROUP_SIZE:
        q = quantize(torch.zeros(0, 128), fmt)
        assert q.shape == (0, 128) and dequantize(q).shape == (0, 128)
        assert q.to("cpu").shape == q.shape and q.to("cpu").fmt == fmt


# ---------------------------------------------------------------------------------------------
# int4_pg and int8: the integer formats

import dataclasses

import numpy as np

from w4a4_book.formats import (FORMATS, INT_MAX_ABS, PG_GROUP, QFORMATS, check_fmt, to_int4_pg)


def scalar_int4_pg(x):
    "The int4_pg rule written again in numpy float32, step by step: (codes int [rows, K], u [rows, K/64], base [rows])."
    f = np.float32
    x = x.numpy().astype(f)
    rows, K = x.shape
    G = K // PG_GROUP
    amax = np.abs(x).reshape(rows, G, PG_GROUP).max(-1) if G else np.zeros((rows, 0), f)
    s = (amax / f(7)).astype(f)
    base = (s.max(1) if G else np.zeros(rows, f)) / f(15)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(base[:, None] > 0, np.clip(np.rint(s / base[:, None]), 1, 15), 1).astype(f)
        scale = (base[:, None] * u).astype(f)
        r = np.minimum(f(1) / scale[..., None], np.finfo(f).max).astype(f)   # the reciprocal, saturated
        t = (x.reshape(rows, G, PG_GROUP) * r).astype(f)
        q = np.where(scale[..., None] > 0, np.clip(np.rint(t), -8, 7), 0)
    return q.reshape(rows, K).astype(np.int64), u.astype(np.int64), base


def scalar_int8(x):
    f = np.float32
    x = x.numpy().astype(f)
    amax = np.abs(x).max(1) if x.shape[1] else np.zeros(x.shape[0], f)
    base = (amax / f(127)).astype(f)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.minimum(f(1) / base[:, None], np.finfo(f).max).astype(f)
        q = np.where(base[:, None] > 0, np.clip(np.rint((x * r).astype(f)), -127, 127), 0)
    return q.astype(np.int64), base


def test_check_fmt_allowed():
    assert FORMATS == ("int4", "nvfp4") and QFORMATS == ("int4", "nvfp4", "int4_pg", "int8")
    assert check_fmt("int8", QFORMATS) == "int8"
    with pytest.raises(ValueError, match="fmt='int4_pg' is not accepted here"):
        check_fmt("int4_pg")
    with pytest.raises(ValueError, match="fmt='int5' is not a known format"):
        check_fmt("int5", QFORMATS)
    assert GROUP_SIZE == {"int4": 64, "nvfp4": 16}                 # what chapters 6-11 key on, unchanged


def test_int4_pg_hand_checked():
    x = torch.zeros(3, 256)
    x[0, :4] = torch.tensor([105.0, -37.5, 52.5, 7.5])     # s = 15: base = 1, u = 15; 1/15 rounds up, so x·(1/15) is
    # -2.5000002 -> -3 and 3.5000002 -> 4 (no longer ties), while 7.5·(1/15) rounds to 0.5 exactly -> 0 (tie to even)
    x[0, 64:66] = torch.tensor([17.5, -17.5])              # s = 2.5 -> u = 2 (tie down): 8.75 clamps to 7 and -8
    x[0, 128] = 24.5                                       # s = 3.5 -> u = 4 (tie up)
    x[0, 192] = 2.1                                        # s = 0.3 -> round to 0 -> u = 1
    x[2, :64] = -3.0                                       # all-equal single group, other groups zero
    q = quantize(x, "int4_pg")
    assert q.base.tolist() == [1.0, 0.0, (torch.tensor(3.0) / 7 / 15).item()]
    assert q.scales.tolist() == [[15, 1, 15], [2, 1, 1], [4, 1, 1], [1, 1, 1]]
    c = unpack_int4(q.data)
    assert c[0, :4].tolist() == [7, -3, 4, 0] and c[0, 64:66].tolist() == [7, -8]
    assert c[0, 128].item() == 6 and c[0, 192].item() == 2
    assert c[1].abs().sum().item() == 0 and c[2, :64].unique().tolist() == [-7]
    assert dequantize(q)[0, 64:66].tolist() == [14.0, -16.0]
    assert (q.packing, q.group_size, q.scales.dtype, q.base.dtype) == ("nibbles", 64, torch.uint8, torch.float32)


def test_int4_pg_emits_minus_eight():
    "Groups whose small u rounds down clamp; with group magnitudes spread over a row some do, and -8 appears."
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 1024, generator=g) * torch.exp(torch.randn(64, 16, 1, generator=g)).repeat_interleave(64, 1)[..., 0]
    assert unpack_int4(quantize(x, "int4_pg").data).min().item() == -8


def test_int8_hand_checked():
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5, -2.0, 2.5], [0.0] * 6, [-1e-3] + [0.0] * 5])
    q = quantize(x, "int8")
    assert q.base[:2].tolist() == [1.0, 0.0] and q.base[2].item() == (torch.tensor(1e-3) / 127).item()
    assert q.data.tolist() == [[127, -64, 0, 2, -2, 2], [0] * 6, [-127] + [0] * 5]
    assert (q.packing, q.scales, q.data.dtype, q.group_size) == ("int8", None, torch.int8, 6)
    assert dequantize(q)[0].tolist() == [127.0, -64.0, 0.0, 2.0, -2.0, 2.0]


def test_zero_empty_and_to():
    for fmt in ("int4_pg", "int8"):
        z = quantize(torch.zeros(2, 128), fmt)
        assert z.base.tolist() == [0.0, 0.0] and z.as_int8().data.abs().sum().item() == 0
        assert torch.equal(dequantize(z), torch.zeros(2, 128))
        for shape in ((0, 128), (3, 0)):
            e = quantize(torch.zeros(shape), fmt)
            assert e.shape == shape and dequantize(e).shape == shape and e.base.shape == (shape[0],)
        m = z.to("cpu")
        assert m.fmt == fmt and torch.equal(m.base, z.base) and m.packing == z.packing
    assert quantize(torch.zeros(2, 128), "int4_pg").scales.unique().tolist() == [1]


def test_frozen():
    q = quantize(torch.randn(2, 64), "int4_pg")
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.base = torch.ones(2)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_int4_pg_matches_scalar_rule(data):
    x = data.draw(int_matrices())
    q = quantize(x, "int4_pg")
    codes, u, base = scalar_int4_pg(x)
    assert np.array_equal(q.base.numpy(), base)
    assert np.array_equal(q.scales.T.long().numpy(), u)
    assert np.array_equal(unpack_int4(q.data).long().numpy(), codes)
    assert np.array_equal(q.as_int8().data.long().numpy(), codes * np.repeat(u, PG_GROUP, 1))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_int8_matches_scalar_rule_and_half_step(data):
    x = data.draw(int_matrices())
    q = quantize(x, "int8")
    codes, base = scalar_int8(x)
    assert np.array_equal(q.base.numpy(), base) and np.array_equal(q.data.long().numpy(), codes)
    err = (x.double() - dequantize(q).double()).abs()
    b = q.base.double()[:, None]
    normal = (b >= torch.finfo(torch.float32).tiny).expand_as(err)
    assert (err[normal] <= (b * (0.5 + 2**-20) + x.double().abs() * 2**-23).expand_as(err)[normal]).all()
    amax = x.double().abs().amax(1, keepdim=True) if x.shape[1] else b
    # a rounding flipped by the reciprocal's two roundings moves a code by 1 only where |t| is within |t| * 2^-23 of a tie
    # and a subnormal base (its reciprocal may saturate at FLT_MAX) keeps the error within amax
    subnormal = torch.where(b < torch.finfo(torch.float32).tiny, amax, 0.0)
    assert (err <= torch.maximum(torch.maximum(b / 2, amax - 127 * b) * (1 + 2**-20) + x.double().abs() * 2**-22 + 2**-140,
                                 subnormal)).all()


def check_int4_pg_bound(x):
    G = PG_GROUP
    q = quantize(x, "int4_pg")
    err = group_view((x.double() - dequantize(q).double()).abs(), G)
    scale = (q.base.double()[:, None] * q.scales.double().T).unsqueeze(-1)
    ax = group_view(x.double().abs(), G)
    amax = ax.amax(-1, keepdim=True)
    slack = ax * 2**-22 + 2**-140
    # every element: half a step, or (clamped) what lies beyond 7 steps
    # (a subnormal step's reciprocal may saturate at FLT_MAX: the error then stays within amax)
    subnormal = torch.where(scale < 2**-126, amax, 0.0)
    assert (err <= torch.maximum(torch.maximum(scale * (0.5 + 2**-19), amax - 7 * scale * (1 - 2**-20)) + slack, subnormal)).all()
    # unclamped elements (-8.5 <= t <= 7.5, with some margin) are within half a step
    t = group_view(x.double(), G) / scale
    inside = (t < 7.5 * (1 - 2**-20)) & (t > -8.5 * (1 - 2**-20)) & (scale >= 2**-126)
    assert (err[inside] <= (scale * (0.5 + 2**-19)).expand_as(err)[inside] + slack[inside]).all()
    # a group whose u did not round down holds no clamped element (normal steps)
    s = (group_view(x.abs(), G).amax(-1) / 7).double().unsqueeze(-1)            # float32 s, as the rule computes it
    up = ((scale >= s) & (s >= 2**-126)).expand_as(err)
    assert (err[up] <= (scale * (0.5 + 2**-19)).expand_as(err)[up] + slack[up]).all()
    # clamped error is at most 3.5 base (rows with a normal base)
    base = q.base.double()[:, None, None].expand_as(err)
    normal = base >= 2**-126
    bound = torch.maximum(scale * (0.5 + 2**-19), 3.5 * base * (1 + 2**-18)).expand_as(err) + slack
    assert (err[normal] <= bound[normal]).all()


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_int4_pg_half_step_bound(data):
    check_int4_pg_bound(data.draw(int_matrices()))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_int4_pg_packings_agree(data):
    x = data.draw(int_matrices())
    q = quantize(x, "int4_pg")
    q8 = q.as_int8()
    assert q8.packing == "int8" and q8.data.dtype == torch.int8 and q8.shape == q.shape
    assert torch.equal(q8.data.long(), unpack_int4(q.data).long() * q.scales.T.long().repeat_interleave(PG_GROUP, 1))
    assert int(q8.data.abs().max()) <= INT_MAX_ABS["int4_pg"]
    assert torch.equal(q8.as_nibbles().data, q.data) and q8.as_int8() is q8
    assert torch.equal(dequantize(q8), dequantize(q))
    bare = QTensor(q8.data, None, "int4_pg", base=q8.base)
    assert torch.equal(dequantize(bare), dequantize(q))
    assert torch.equal(dequantize(q), q8.data.float() * q.base[:, None])        # (q*u)*base, one rounding


def test_to_int4_pg_rules():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 512, generator=g) * torch.exp(torch.randn(32, 512, generator=g))
    for scale_dtype in (torch.float16, torch.bfloat16):
        q4 = quantize(w, "int4", scale_dtype)
        req, keep = to_int4_pg(q4), to_int4_pg(q4, "keep_codes")
        assert req.fmt == keep.fmt == "int4_pg" and req.packing == keep.packing == "nibbles"
        assert torch.equal(req.base, keep.base) and torch.equal(req.scales, keep.scales)
        assert torch.equal(keep.data, q4.data)
        v4 = dequantize(q4)
        assert ((dequantize(req) - v4).abs() <= (dequantize(keep) - v4).abs() * (1 + 2**-20) + 2**-60).all()
        assert torch.equal(req.data, quantize(v4, "int4_pg").data)
    pg = quantize(w, "int4_pg")
    assert to_int4_pg(pg) is pg and torch.equal(to_int4_pg(pg.as_int8()).data, pg.data)


def test_int_qtensor_validation():
    q = quantize(torch.randn(4, 128), "int4_pg")
    q8, i8 = q.as_int8(), quantize(torch.randn(4, 128), "int8")
    base = q.base
    bad = [
        (lambda: QTensor(q.data, q.scales, "int4_pg"), TypeError, "base must be a torch.float32 tensor"),
        (lambda: QTensor(q.data, q.scales, "int4_pg", base=base.double()), TypeError, "base must have dtype torch.float32"),
        (lambda: QTensor(q.data, q.scales, "int4_pg", base=base[:2]), ValueError, r"base must have shape \(4,\)"),
        (lambda: QTensor(q.data, q.scales, "int4_pg", base=torch.ones(4, 2)[:, 0]), ValueError, "base must be contiguous"),
        (lambda: QTensor(q.data, q.scales, "int4_pg", base=-base - 1), ValueError, "base must be finite and >= 0"),
        (lambda: QTensor(q.data, q.scales, "int4_pg", base=base + float("nan")), ValueError, "base must be finite"),
        (lambda: QTensor(q.data, q.scales, "int4_pg", base=torch.ones(4, device="meta")), ValueError,
         "base is on meta but data is on cpu"),
        (lambda: QTensor(q.data, torch.zeros_like(q.scales), "int4_pg", base=base), ValueError, r"must lie in \[1, 15\]"),
        (lambda: QTensor(q.data, q.scales + 15, "int4_pg", base=base), ValueError, r"must lie in \[1, 15\]"),
        (lambda: QTensor(q.data, q.scales.to(torch.int8), "int4_pg", base=base), TypeError, "scales must have dtype torch.uint8"),
        (lambda: QTensor(q.data, q.scales.T.contiguous(), "int4_pg", base=base), ValueError, r"scales must have shape \(2, 4\)"),
        (lambda: QTensor(q.data, torch.ones(2, 8, dtype=torch.uint8)[:, ::2], "int4_pg", base=base), ValueError,
         "scales must be contiguous"),
        (lambda: QTensor(q.data, torch.ones(2, 4, dtype=torch.uint8, device="meta"), "int4_pg", base=base), ValueError,
         "scales is on meta"),
        (lambda: QTensor(q.data, None, "int4_pg", base=base), TypeError, "scales .* must be given for int4_pg in nibbles"),
        (lambda: QTensor(q.data, q.scales, "int4_pg", torch.tensor(1.0), base), ValueError, "global_scale must be None"),
        (lambda: QTensor(q.data.to(torch.int16), q.scales, "int4_pg", base=base), TypeError, "data must have dtype in"),
        (lambda: QTensor(q.data[:, :40].contiguous(), q.scales, "int4_pg", base=base), ValueError, "K=80 codes per row"),
        (lambda: QTensor(q.data.T.contiguous().T, q.scales, "int4_pg", base=base), ValueError, "data must be contiguous"),
        (lambda: QTensor(q.data[0], q.scales, "int4_pg", base=base), ValueError, "data must be 2-D"),
        (lambda: QTensor(q.data.numpy(), q.scales, "int4_pg", base=base), TypeError, "data must be a torch.Tensor"),
        (lambda: QTensor(torch.full_like(q8.data, 121), None, "int4_pg", base=base), ValueError, r"\[-120, 120\]"),
        (lambda: QTensor(torch.full_like(q8.data, -121), None, "int4_pg", base=base), ValueError, r"\[-120, 120\]"),
        (lambda: QTensor(q8.data + 1, q8.scales, "int4_pg", base=base), ValueError, "data must be q\\*u"),
        (lambda: QTensor(torch.full_like(q8.data, 120), torch.full_like(q.scales, 1), "int4_pg", base=base), ValueError,
         "data must be q\\*u"),
        (lambda: QTensor(i8.data, q.scales, "int8", base=i8.base), ValueError, "scales must be None for int8"),
        (lambda: QTensor(i8.data.to(torch.uint8), None, "int8", base=i8.base), TypeError, "data must have dtype in"),
        (lambda: QTensor(torch.full_like(i8.data, -128), None, "int8", base=i8.base), ValueError, r"\[-127, 127\]"),
        (lambda: QTensor(i8.data, None, "int8"), TypeError, "base must be a torch.float32 tensor"),
        (lambda: QTensor(q.data, q.scales.half(), "int4", base=base), ValueError, "base must be None for int4"),
        (lambda: QTensor(q.data, q.scales, "int5", base=base), ValueError, "fmt='int5'"),
    ]
    for call, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            call()
    QTensor(torch.full_like(q8.data, -120), torch.full_like(q.scales, 15), "int4_pg", base=base)   # the extremes are fine
    QTensor(torch.full_like(i8.data, -127), None, "int8", base=i8.base)
    meta = QTensor(torch.zeros(4, 64, dtype=torch.uint8, device="meta"), torch.ones(2, 4, dtype=torch.uint8, device="meta"),
                   "int4_pg", base=torch.ones(4, device="meta"))
    assert meta.shape == (4, 128) and meta.device.type == "meta"


@pytest.mark.parametrize("call,exc,msg", [
    (lambda x: quantize(x, "int4_pg", torch.float16), ValueError, "scale_dtype=torch.float16 is not allowed for int4_pg"),
    (lambda x: quantize(x, "int8", torch.bfloat16), ValueError, "is not allowed for int8"),
    (lambda x: quantize(x[:, :96], "int4_pg"), ValueError, "K=96, not a multiple of the int4_pg group size 64"),
    (lambda x: quantize(x.int(), "int8"), TypeError, "x must have dtype"),
    (lambda x: quantize(x[0], "int4_pg"), ValueError, "x must be 2-D"),
    (lambda x: quantize(x * float("inf"), "int4_pg"), ValueError, "x must be finite"),
    (lambda x: dequantize(quantize(x, "int4_pg"), "int8"), ValueError, "does not match q.fmt"),
    (lambda x: quantize(x, "int4").as_int8(), ValueError, "as_int8 needs an int4_pg or int8 QTensor"),
    (lambda x: quantize(x, "int8").as_nibbles(), ValueError, "as_nibbles needs an int4_pg QTensor"),
    (lambda x: QTensor(quantize(x, "int4_pg").as_int8().data, None, "int4_pg", base=torch.ones(3)).as_nibbles(),
     ValueError, "as_nibbles needs scales"),
    (lambda x: to_int4_pg(x), TypeError, "q must be a QTensor"),
    (lambda x: to_int4_pg(quantize(x, "int4"), "nearest"), ValueError, "rule='nearest' must be one of"),
    (lambda x: to_int4_pg(quantize(x, "int4"), None), ValueError, "rule=None must be one of"),
    (lambda x: to_int4_pg(quantize(x, "int8")), ValueError, "q.fmt='int8': to_int4_pg converts int4"),
])
def test_int_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call(torch.randn(3, 128))


@pytest.mark.parametrize("fmt", ["int4_pg", "int8"])
def test_int_formats_refuse_values_past_their_float32_range(fmt):
    x = torch.ones(2, 64)
    x[1, 3] = INT_RANGE_LIMIT
    with pytest.raises(ValueError, match="magnitude >= 2\\^127"):
        quantize(x, fmt)
    x[1, 3] = INT_RANGE_LIMIT / 2
    assert torch.isfinite(dequantize(quantize(x, fmt))).all()


def test_trusted_checks_fields_not_values():
    "`QTensor.trusted` (a kernel's output) skips the value reads that cost a device sync, never the field checks."
    bad = torch.full((2, 64), 127, dtype=torch.int8)              # 127 is no q*u of int4_pg
    with pytest.raises(ValueError, match="data must"):
        QTensor(bad, None, "int4_pg", base=torch.ones(2))
    q = QTensor.trusted(bad, None, "int4_pg", base=torch.ones(2))
    assert q.fmt == "int4_pg" and q.shape == (2, 64)
    with pytest.raises(ValueError, match="base"):
        QTensor.trusted(bad, None, "int4_pg", base=torch.ones(3))   # a wrong shape is still refused
    with pytest.raises(ValueError, match="data must lie"):
        QTensor(torch.full((2, 64), -128, dtype=torch.int8), None, "int8", base=torch.ones(2))   # and checks come back after
