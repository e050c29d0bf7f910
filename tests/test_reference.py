"Tests of the float32 reference operator in `w4a4_book.reference`."
import pytest
import torch

from w4a4_book.formats import GROUP_SIZE, QTensor, decode_table, dequantize, pack_nibbles, quantize, unpack_nibbles
from w4a4_book.operands import check_operands
from w4a4_book.reference import w4a4_gemm_dequant, w4a4_gemm_ref

FORMATS = tuple(GROUP_SIZE)


def operands(fmt, M=16, N=32, K=512, R=32, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    x[:, 3] *= 30                                    # an outlier channel
    lora_act, lora_up = (torch.randn(M, R, generator=g).to(dtype), torch.randn(N, R, generator=g).to(dtype))
    wcscales, bias = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype), torch.randn(N, generator=g).to(dtype)
    return quantize(x, fmt), quantize(w, fmt), lora_act, lora_up, wcscales, bias


def float64_operator(act, wgt, lora_act, lora_up, wcscales, bias):
    "The formula evaluated in float64 with an independent decode path (einsum over groups)."
    def vals(q):
        return decode_table(q.fmt).double()[unpack_nibbles(q.data).long()].reshape(q.rows, -1, q.group_size)
    part = torch.einsum("mgk,ngk->gmn", vals(act), vals(wgt))
    y = (act.scales.double()[:, :, None] * wgt.scales.double()[:, None, :] * part).sum(0)
    if act.fmt == "nvfp4":
        y = y * act.global_scale.double() * wgt.global_scale.double()
    return (y + lora_act.double() @ lora_up.double().T) * wcscales.double() + bias.double()


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_matches_float64_formula(fmt):
    ops = operands(fmt)
    y = w4a4_gemm_ref(*ops)
    assert y.dtype == torch.float32 and y.shape == (16, 32)
    y64 = float64_operator(*ops)
    A, W = dequantize(ops[0]).double(), dequantize(ops[1]).double()
    scale = (A.abs() @ W.abs().T + (ops[2].double().abs() @ ops[3].double().abs().T)) * ops[4].double().abs()
    assert ((y.double() - y64).abs() <= 2 * 512 * 2.0**-24 * scale + 1e-6).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("with_extras", [False, True])
def test_two_paths_agree_to_fp32_rounding(fmt, with_extras):
    act, wgt, *extras = operands(fmt, M=33, N=40, K=1024)
    if not with_extras:
        extras = [None] * 4
    y1, y2 = w4a4_gemm_ref(act, wgt, *extras), w4a4_gemm_dequant(act, wgt, *extras)
    A, W = dequantize(act), dequantize(wgt)
    bound = 2 * act.k * 2.0**-24 * (A.abs() @ W.abs().T)
    if with_extras:
        lora_act, lora_up, wcscales, _ = extras
        bound = (bound + 2**-22 * (lora_act.float().abs() @ lora_up.float().abs().T)) * wcscales.float().abs()
    assert ((y1 - y2).abs() <= bound + 1e-6).all()


def test_int4_group_sums_are_exact():
    "Extreme codes (-8 everywhere) with unit scales: every group sums to exactly 64*64."
    G, K = GROUP_SIZE["int4"], 256
    codes = torch.full((3, K), 8, dtype=torch.uint8)          # nibble 8 = -8
    q = QTensor(pack_nibbles(codes), torch.ones(K // G, 3, dtype=torch.float16), "int4")
    y = w4a4_gemm_ref(q, q)
    assert torch.equal(y, torch.full((3, 3), 64.0 * K))


def test_epilogue_order_wcscales_scales_lora_too():
    "Zero codes leave only the epilogue: (lora_act @ lora_up.T) * wcscales + bias."
    K, M, N, R = 64, 2, 3, 16
    q = lambda rows: QTensor(torch.zeros(rows, K // 2, dtype=torch.uint8),
                             torch.ones(1, rows, dtype=torch.float16), "int4")
    la, lu = torch.ones(M, R), torch.ones(N, R)
    wc, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.0, -1.0])
    y = w4a4_gemm_ref(q(M), q(N), la, lu, wc, b)
    assert y.tolist() == [[16.5, 32.0, 47.0]] * 2


def test_rank_zero_lora_is_no_lora():
    act, wgt, *_ = operands("int4", R=16)
    empty_a, empty_u = torch.zeros(16, 0), torch.zeros(32, 0)
    assert torch.equal(w4a4_gemm_ref(act, wgt, empty_a, empty_u), w4a4_gemm_ref(act, wgt))
    assert check_operands(act, wgt, empty_a, empty_u) == (16, 32, 512, 0)


def test_nvfp4_global_scales_multiply():
    act, wgt, *_ = operands("nvfp4")
    y = w4a4_gemm_ref(act, wgt)
    act2 = QTensor(act.data, act.scales, "nvfp4", act.global_scale * 2)
    assert torch.allclose(w4a4_gemm_ref(act2, wgt), 2 * y, rtol=1e-6, atol=0)


OPS = operands("int4", M=4, N=8, K=128, R=16)
ACT, WGT, LA, LU, WC, B = OPS


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(act=dequantize(ACT)), TypeError, "act must be a QTensor"),
    (dict(wgt="w"), TypeError, "wgt must be a QTensor"),
    (dict(wgt=quantize(torch.randn(8, 128), "nvfp4")), ValueError, "act.fmt='int4' and wgt.fmt='nvfp4' differ"),
    (dict(fmt="nvfp4"), ValueError, "fmt='nvfp4' does not match"),
    (dict(fmt="int2"), ValueError, "fmt='int2'"),
    (dict(fmt=4), TypeError, "fmt must be a str"),
    (dict(wgt=quantize(torch.randn(8, 256), "int4")), ValueError, "act has K=128 but wgt has K=256"),
    (dict(lora_up=None), ValueError, "lora_act and lora_up must be given together"),
    (dict(lora_act=None), ValueError, "lora_act and lora_up must be given together"),
    (dict(lora_act=LA[:, :8], lora_up=LU[:, :8]), ValueError, "lora_act has rank R=8, not a multiple of 16"),
    (dict(lora_act=LA[:2]), ValueError, r"lora_act must have shape \[M, R\]"),
    (dict(lora_up=LU[:, :0]), ValueError, r"lora_up must have shape \[N, R\]"),
    (dict(lora_act=LA[:, :, None]), ValueError, "lora_act must be 2-D"),
    (dict(lora_act=LA.to(torch.int16)), TypeError, "lora_act must have dtype"),
    (dict(lora_up=LU.double()), TypeError, "lora_up must have dtype"),
    (dict(lora_up=LU.tolist()), TypeError, "lora_up must be a torch.Tensor"),
    (dict(wcscales=WC[:4]), ValueError, r"wcscales must have shape \[N\]"),
    (dict(wcscales=WC.int()), TypeError, "wcscales must have dtype"),
    (dict(bias=B[None]), ValueError, r"bias must have shape \[N\]"),
    (dict(bias=[0.0] * 8), TypeError, "bias must be a torch.Tensor or None"),
])
@pytest.mark.parametrize("fn", [w4a4_gemm_ref, w4a4_gemm_dequant])
def test_bad_input(fn, kwargs, exc, msg):
    args = dict(act=ACT, wgt=WGT, lora_act=LA, lora_up=LU, wcscales=WC, bias=B)
    args.update(kwargs)
    with pytest.raises(exc, match=msg):
        fn(**args)


# ---------------------------------------------------------------------------------------------
# Integer formats: int4_pg x int4_pg and int8 x int4_pg

from hypothesis import given, settings, strategies as st

from w4a4_book.formats import INT_MAX_ABS, unpack_int4
from w4a4_book.operands import OPERAND_PAIRS, check_int32_sum, int32_k_limit
from w4a4_book.reference import int_accumulator, w4a4_gemm_exact

INT_PAIRS = [("int4_pg", "int4_pg"), ("int8", "int4_pg")]


def int_operands(act_fmt, M=16, N=32, K=512, R=32, seed=0, dtype=torch.bfloat16, packing="nibbles"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, K // 64, 1, generator=g)).repeat_interleave(64, 1)[..., 0]
    w = torch.randn(N, K, generator=g)
    x[:, 3] *= 30
    act, wgt = quantize(x, act_fmt), quantize(w, "int4_pg")
    if packing == "int8":
        act, wgt = act.as_int8(), wgt.as_int8()
    la, lu = torch.randn(M, R, generator=g).to(dtype), torch.randn(N, R, generator=g).to(dtype)
    wc, b = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype), torch.randn(N, generator=g).to(dtype)
    return act, wgt, la, lu, wc, b


def extreme(rows, K, fmt):
    "Every value at the format's largest magnitude: q*u = -120 for int4_pg, -127 for int8."
    if fmt == "int8":
        return QTensor(torch.full((rows, K), -127, dtype=torch.int8), None, "int8", base=torch.ones(rows))
    return QTensor(pack_nibbles(torch.full((rows, K), 8, dtype=torch.uint8)), torch.full((K // 64, rows), 15, dtype=torch.uint8),
                   "int4_pg", base=torch.ones(rows))


def test_allowed_pairs():
    assert OPERAND_PAIRS == (("int4", "int4"), ("nvfp4", "nvfp4"), ("int4_pg", "int4_pg"), ("int8", "int4_pg"))
    x = torch.randn(4, 128)
    q = {f: quantize(x, f) for f in ("int4", "nvfp4", "int4_pg", "int8")}
    for a in q:
        for w in q:
            if (a, w) in OPERAND_PAIRS:
                assert check_operands(q[a], q[w]) == (4, 4, 128, 0)
            else:
                with pytest.raises(ValueError, match=f"act.fmt='{a}' and wgt.fmt='{w}'.*not an allowed"):
                    check_operands(q[a], q[w])


def test_int32_limits():
    assert int32_k_limit("int4_pg", "int4_pg") == 149130 and int32_k_limit("int8", "int4_pg") == 140911
    for a, w in INT_PAIRS:
        lim = int32_k_limit(a, w)
        assert lim * INT_MAX_ABS[a] * INT_MAX_ABS[w] < 2**31 <= (lim + 1) * INT_MAX_ABS[a] * INT_MAX_ABS[w]
        check_int32_sum(lim, a, w)
        with pytest.raises(ValueError, match=f"K={lim + 1} is too long for an exact int32 sum of {a} x {w}"):
            check_int32_sum(lim + 1, a, w)
    for a, w in (("int4", "int4"), ("nvfp4", "nvfp4")):
        assert int32_k_limit(a, w) is None
        check_int32_sum(10**9, a, w)
    with pytest.raises(TypeError, match="K must be an int"):
        check_int32_sum(True, "int4_pg", "int4_pg")
    with pytest.raises(ValueError, match="act_fmt='fp8'"):
        int32_k_limit("fp8", "int4_pg")


@pytest.mark.parametrize("act_fmt", ["int4_pg", "int8"])
def test_longest_k_is_exact_and_one_group_more_is_refused(act_fmt):
    lim = int32_k_limit(act_fmt, "int4_pg")
    K = lim // 64 * 64
    a, w = extreme(2, K, act_fmt), extreme(3, K, "int4_pg")
    want = INT_MAX_ABS[act_fmt] * 120 * K
    assert want < 2**31
    assert torch.equal(int_accumulator(a, w), torch.full((2, 3), want, dtype=torch.int64))
    assert torch.equal(w4a4_gemm_exact(a, w), torch.full((2, 3), float(want), dtype=torch.float64))
    a2, w2 = extreme(2, K + 64, act_fmt), extreme(3, K + 64, "int4_pg")
    for fn in (w4a4_gemm_ref, w4a4_gemm_dequant, w4a4_gemm_exact, int_accumulator, check_operands):
        with pytest.raises(ValueError, match=f"K={K + 64} is too long"):
            fn(a2, w2)


@pytest.mark.parametrize("act_fmt", ["int4_pg", "int8"])
@pytest.mark.parametrize("packing", ["nibbles", "int8"])
def test_int_accumulator_is_the_int64_sum(act_fmt, packing):
    act, wgt, *_ = int_operands(act_fmt, K=1024, packing=packing)
    want = act.as_int8().data.long() @ wgt.as_int8().data.long().T            # an int64 matrix product, on the CPU
    got = int_accumulator(act, wgt)
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_exact_epilogue_order_by_hand():
    "(base_a*base_w*acc + lora_act@lora_up.T) * wcscales + bias, with numbers small enough to check by hand."
    K, R = 64, 16
    act = QTensor(torch.ones(1, K, dtype=torch.int8), None, "int8", base=torch.tensor([0.5]))
    wgt = QTensor(torch.full((2, K), 2, dtype=torch.int8), None, "int4_pg", base=torch.tensor([0.25, 1.0]))
    la, lu = torch.ones(1, R), torch.ones(2, R)
    wc, b = torch.tensor([2.0, -1.0]), torch.tensor([1.0, 0.5])
    y = w4a4_gemm_exact(act, wgt, la, lu, wc, b)
    assert y.dtype == torch.float64 and y.tolist() == [[(128 * 0.5 * 0.25 + 16) * 2 + 1, (128 * 0.5 + 16) * -1 + 0.5]]
    assert w4a4_gemm_ref(act, wgt, la, lu, wc, b).tolist() == y.float().tolist()
    assert w4a4_gemm_exact(act, wgt).tolist() == [[16.0, 64.0]]


@pytest.mark.parametrize("act_fmt", ["int4_pg", "int8"])
@pytest.mark.parametrize("with_extras", [False, True])
def test_float32_paths_within_rounding_of_exact(act_fmt, with_extras):
    act, wgt, *extras = int_operands(act_fmt, M=33, N=40, K=1024)
    if not with_extras:
        extras = [None] * 4
    ex = w4a4_gemm_exact(act, wgt, *extras)
    A = act.as_int8().data.double() * act.base.double()[:, None]
    W = wgt.as_int8().data.double() * wgt.base.double()[:, None]
    mag = A.abs() @ W.abs().T
    if with_extras:
        la, lu, wc, b = (t.double() for t in extras)
        mag = (mag + la.abs() @ lu.abs().T) * wc.abs() + b.abs()
    y_ref, y_deq = w4a4_gemm_ref(act, wgt, *extras), w4a4_gemm_dequant(act, wgt, *extras)
    assert y_ref.dtype == torch.float32 and y_ref.shape == (33, 40)
    assert ((y_ref.double() - ex).abs() <= (8 + 32) * 2.0**-24 * mag + 1e-30).all()    # no K factor: the sum is exact
    assert ((y_deq.double() - ex).abs() <= 2 * 1024 * 2.0**-24 * mag + 1e-30).all()


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_exact_equals_float64_dequant_product(data):
    act_fmt = data.draw(st.sampled_from(["int4_pg", "int8"]))
    M, N, ngroups, R = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4)), 16
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    K = 64 * ngroups
    mag = lambda rows: 2.0 ** data.draw(st.integers(-30, 30)) * torch.exp(2 * torch.randn(rows, ngroups, 1, generator=g)
                                                                         ).repeat_interleave(64, 1)[..., 0]
    x, w = torch.randn(M, K, generator=g) * mag(M), torch.randn(N, K, generator=g) * mag(N)
    if data.draw(st.booleans()):
        x[0] = 0.0                                                   # a zero row: base 0
    act, wgt = quantize(x, act_fmt), quantize(w, "int4_pg")
    if data.draw(st.booleans()):
        act, wgt = act.as_int8(), wgt.as_int8()
    la, lu = torch.randn(M, R, generator=g), torch.randn(N, R, generator=g)
    wc, b = 1 + 0.1 * torch.randn(N, generator=g), torch.randn(N, generator=g)
    ex = w4a4_gemm_exact(act, wgt, la, lu, wc, b)
    A = act.as_int8().data.double() * act.base.double()[:, None]        # (q*u)*base is exact in float64
    W = wgt.as_int8().data.double() * wgt.base.double()[:, None]
    ref64 = (A @ W.T + la.double() @ lu.double().T) * wc.double() + b.double()
    bound = 4 * (K + R) * 2.0**-53 * ((A.abs() @ W.abs().T + la.double().abs() @ lu.double().abs().T) * wc.double().abs()
                                     + b.double().abs())
    assert ((ex - ref64).abs() <= bound).all()
    acc = int_accumulator(act, wgt)
    assert torch.equal(acc, act.as_int8().data.long() @ wgt.as_int8().data.long().T)


def test_int_fmt_argument():
    act, wgt, *_ = int_operands("int8")
    assert check_operands(act, wgt, fmt="int4_pg") == (16, 32, 512, 0)
    with pytest.raises(ValueError, match=r"fmt='int8' does not match the operands' format 'int4_pg' \(the weights'\)"):
        check_operands(act, wgt, fmt="int8")
    pg, _, *_ = int_operands("int4_pg")
    with pytest.raises(ValueError, match="fmt='int4' does not match the operands' format 'int4_pg'$"):
        check_operands(pg, wgt, fmt="int4")


INT_OPS = int_operands("int8", M=4, N=8, K=128, R=16)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(act=dequantize(INT_OPS[0])), TypeError, "act must be a QTensor"),
    (dict(act=INT_OPS[1], wgt=INT_OPS[0]), ValueError, "act.fmt='int4_pg' and wgt.fmt='int8' differ: not an allowed"),
    (dict(wgt=quantize(torch.randn(8, 128), "int4")), ValueError, "act.fmt='int8' and wgt.fmt='int4' differ"),
    (dict(wgt=quantize(torch.randn(8, 128), "int8")), ValueError, "act.fmt='int8' and wgt.fmt='int8': not an allowed"),
    (dict(wgt=quantize(torch.randn(8, 256), "int4_pg")), ValueError, "act has K=128 but wgt has K=256"),
    (dict(lora_up=None), ValueError, "lora_act and lora_up must be given together"),
    (dict(lora_act=INT_OPS[2][:, :8], lora_up=INT_OPS[3][:, :8]), ValueError, "lora_act has rank R=8, not a multiple of 16"),
    (dict(wcscales=INT_OPS[4][:4]), ValueError, r"wcscales must have shape \[N\]"),
    (dict(bias=INT_OPS[5].int()), TypeError, "bias must have dtype"),
])
@pytest.mark.parametrize("fn", [w4a4_gemm_ref, w4a4_gemm_dequant, w4a4_gemm_exact])
def test_int_bad_input(fn, kwargs, exc, msg):
    args = dict(act=INT_OPS[0], wgt=INT_OPS[1], lora_act=INT_OPS[2], lora_up=INT_OPS[3], wcscales=INT_OPS[4], bias=INT_OPS[5])
    args.update(kwargs)
    with pytest.raises(exc, match=msg):
        fn(**args)


def test_exact_refuses_float_formats():
    for fn in (w4a4_gemm_exact, int_accumulator):
        with pytest.raises(ValueError, match="act.fmt='int4'"):
            fn(ACT, WGT)
