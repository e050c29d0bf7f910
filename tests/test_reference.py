"Tests of the float32 reference operator in `w4a4_book.reference`."
import pytest
import torch

from w4a4_book.formats import GROUP_SIZE, QTensor, decode_table, dequantize, pack_nibbles, quantize, unpack_nibbles
from w4a4_book.reference import check_operands, w4a4_gemm_dequant, w4a4_gemm_ref

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
    (dict(lora_act=LA[:, :8], lora_up=LU[:, :8]), ValueError, "lora rank R=8 is not a multiple of 16"),
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
