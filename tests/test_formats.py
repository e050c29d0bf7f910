"Bit-exact and property-based tests of the 4-bit formats in `w4a4_book.formats`."
import pytest
import torch
from hypothesis import given, settings, strategies as st

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
    # always: half a step, or the clamp at +-7 (only possible for subnormal scales)
    assert (err <= torch.maximum(s / 2, amax - 7 * s) * (1 + 2**-20)).all()
    # groups with a normal scale: half a step, full stop
    normal = (s >= torch.finfo(scale_dtype).tiny).expand_as(err)
    assert (err[normal] <= (s * (0.5 + 2**-21)).expand_as(err)[normal]).all()


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
