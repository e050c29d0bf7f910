"""Tests of `W4A4Linear`: SVDQuant conversion, forward pass, backend dispatch and argument checks; casts; every linear of
a model (subclasses, attention, torch's transformer layers); all-or-nothing loads; the named errors; the randomized SVD."""
import copy
import types

import pytest
import torch
from torch import nn

from w4a4_book.formats import dequantize, quantize, reciprocal
from w4a4_book.layers import W4A4Linear, low_rank, smooth_factors
from w4a4_book.reference import w4a4_gemm_ref
from w4a4_book import act_quant, gemm, registry
from w4a4_book.configs import HopperV1Config, HopperV2Config

FORMATS = ("int4", "nvfp4")


def outlier_problem(K=256, N=128, tokens=64, seed=0):
    "A linear layer with outlier weight columns, and activations with outlier channels."
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) / K**0.5)
        lin.weight[:, :4] *= 8
        lin.bias.copy_(torch.randn(N, generator=g))

    def acts(m):
        x = torch.randn(m, K, generator=g)
        x[:, 10:14] *= 20
        return x
    return lin, acts(tokens), acts(tokens)


def rel_err(layer, lin, x):
    with torch.no_grad():
        ref = lin(x)
        return ((layer(x).float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rank", [0, 32])
def test_buffers(fmt, rank):
    lin, calib, _ = outlier_problem()
    layer = W4A4Linear.from_linear(lin, rank=rank, fmt=fmt, act_sample=calib)
    G = {"int4": 64, "nvfp4": 16}[fmt]
    sd = layer.state_dict()
    assert sd["qweight_data"].shape == (128, 128) and sd["qweight_data"].dtype == torch.uint8
    assert sd["qweight_scales"].shape == (256 // G, 128)
    assert sd["qweight_scales"].dtype == (torch.bfloat16 if fmt == "int4" else torch.float8_e4m3fn)
    assert ("qweight_global_scale" in sd) == (fmt == "nvfp4")
    assert sd["lora_down"].shape == (256, rank) and sd["lora_up"].shape == (128, rank)
    assert sd["smooth"].shape == (256,) and sd["wcscales"].shape == (128,) and sd["bias"].shape == (128,)
    assert all(sd[k].dtype == torch.bfloat16 for k in ("lora_down", "lora_up", "smooth", "wcscales", "bias"))
    assert torch.equal(sd["wcscales"], torch.ones(128, dtype=torch.bfloat16))
    assert layer.qweight.shape == (128, 256) and layer.qweight.fmt == fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_decomposition_reconstructs_weight(fmt):
    "W = (Q(residual) + up @ (down * smooth).T) / smooth, up to the residual's quantization error."
    lin, calib, _ = outlier_problem()
    layer = W4A4Linear.from_linear(lin, rank=32, fmt=fmt, act_sample=calib)
    lam = layer.smooth.float()
    low = layer.lora_up.float() @ (layer.lora_down.float() * lam[:, None]).T
    w_hat = lin.weight.detach() * lam
    resid = w_hat - low
    deq = dequantize(layer.qweight)
    assert torch.allclose(deq, dequantize(quantize(resid, fmt, torch.bfloat16 if fmt == "int4" else None)))
    assert ((deq + low) / lam - lin.weight.detach()).norm() / lin.weight.norm() < 0.2


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_is_the_reference_operator(fmt):
    lin, calib, x = outlier_problem()
    layer = W4A4Linear.from_linear(lin, rank=16, fmt=fmt, act_sample=calib)
    xs = x.float() * reciprocal(layer.smooth.float())
    act = quantize(xs, fmt, torch.bfloat16 if fmt == "int4" else None)
    lora_act = (x @ layer.lora_down.float()).bfloat16()
    expected = w4a4_gemm_ref(act, layer.qweight, lora_act, layer.lora_up, layer.wcscales, layer.bias)
    assert torch.equal(layer(x), expected)
    assert layer.last_backend == "reference"


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_falls_with_rank_and_smoothing(fmt):
    lin, calib, x = outlier_problem()
    plain = rel_err(W4A4Linear.from_linear(lin, rank=0, fmt=fmt), lin, x)
    lowrank = rel_err(W4A4Linear.from_linear(lin, rank=16, fmt=fmt), lin, x)
    svdquant = rel_err(W4A4Linear.from_linear(lin, rank=16, fmt=fmt, act_sample=calib), lin, x)
    svdquant64 = rel_err(W4A4Linear.from_linear(lin, rank=64, fmt=fmt, act_sample=calib), lin, x)
    assert svdquant64 < svdquant < lowrank < plain


def test_leading_dims_dtypes_and_rank_zero():
    lin, calib, _ = outlier_problem()
    layer = W4A4Linear.from_linear(lin, rank=0, act_sample=calib)
    x = torch.randn(2, 3, 5, 256)
    y = layer(x)
    assert y.shape == (2, 3, 5, 128) and y.dtype == torch.float32
    assert torch.equal(y.reshape(-1, 128), layer(x.reshape(-1, 256)))
    assert layer(x[0, 0, 0]).shape == (128,)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert layer(x.half()).dtype == torch.float16
    assert layer(torch.zeros(0, 256)).shape == (0, 128)


def test_state_dict_round_trip():
    lin, calib, x = outlier_problem()
    for fmt in FORMATS:
        a = W4A4Linear.from_linear(lin, rank=32, fmt=fmt, act_sample=calib, dtype=torch.float16)
        b = W4A4Linear(256, 128, rank=32, fmt=fmt, dtype=torch.float16)
        b.load_state_dict(a.state_dict())
        assert torch.equal(a(x), b(x))


def test_no_bias_and_float16():
    lin = nn.Linear(128, 64, bias=False)
    layer = W4A4Linear.from_linear(lin, rank=16, fmt="int4", dtype=torch.float16)
    assert layer.bias is None and layer.lora_up.dtype == torch.float16
    assert layer.qweight_scales.dtype == torch.float16
    assert W4A4Linear.from_linear(lin, rank=16, dtype=torch.float16).qweight_scales.dtype == torch.uint8   # the default: int4_pg
    assert layer(torch.randn(3, 128)).shape == (3, 64)


def test_smooth_factors_and_low_rank():
    w = torch.randn(32, 64)
    x = torch.randn(16, 64)
    x[:, 3] = 0
    lam = smooth_factors(x, w, alpha=0.5)
    assert lam[3] == 1 and torch.allclose(lam[5], (x[:, 5].abs().max() / w[:, 5].abs().max()).sqrt())
    assert torch.equal(smooth_factors(x, w, alpha=0.0)[4:], 1 / w.abs().amax(0)[4:])     # alpha=0: weight side only
    up, down = low_rank(w, 32)
    assert torch.allclose(up @ down.T, w, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Backend dispatch


def test_sm90_shape_conditions(monkeypatch):
    "The shape and format conditions are checked after the device ones; fake a CUDA sm_90 input to reach them."
    x = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert W4A4Linear(256, 128, rank=16, fmt="nvfp4").why_not_sm90(x).startswith("no sm90 kernel: fmt: no kernel computes 'nvfp4'")
    assert W4A4Linear(192, 128, rank=16).why_not_sm90(x) == "in_features: K=192 must be a multiple of 128 (the kernel's K-block)"
    assert W4A4Linear(256, 64, rank=16).why_not_sm90(x) == "out_features: N=64 must be a multiple of 128 (tile N × cluster_n)"
    assert W4A4Linear(512, 256, rank=16, fmt="int4", kernel_config=HopperV2Config(cluster_n=2)).why_not_sm90(x) is None
    assert W4A4Linear(512, 128, rank=16, fmt="int4", kernel_config=HopperV2Config(cluster_n=2)).why_not_sm90(x).startswith("out_features: N=128")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert W4A4Linear(256, 128, rank=16).why_not_sm90(x) == "x is on a GPU of compute capability (8, 0), not (9, 0)"


def test_cpu_backends():
    lin, _, x = outlier_problem()
    layer = W4A4Linear.from_linear(lin, rank=16)
    assert layer.why_not_sm90(x) == "x is on cpu, not a CUDA device"
    for backend in ("auto", "reference"):
        layer.backend = backend
        layer(x)
        assert layer.last_backend == "reference"
    layer.backend = "sm90"
    layer.last_backend = None
    with pytest.raises(ValueError, match="backend='sm90' cannot run: x is on cpu"):
        layer(x)
    assert layer.last_backend is None
    layer.backend = "gpu"
    with pytest.raises(ValueError, match="backend='gpu' must be one of"):
        layer(x)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_dispatch_to_sm90_kernel(monkeypatch, version):
    "With the availability check satisfied, forward hands the kernel exactly the reference's operands."
    calls = []

    def fake_gemm_w4a4(act, wgt, lora_act=None, lora_up=None, wcscales=None, bias=None, *, out_dtype, config):
        y32 = w4a4_gemm_ref(act, wgt, lora_act, lora_up, wcscales, bias)
        calls.append(dict(out_dtype=out_dtype, version=registry.spec_for(config).kernel, y32=y32))
        return y32.to(out_dtype)

    def fake_quantize_lora_down(x, smooth, lora_down_t, fmt):
        "What the fused kernel computes, by the reference rules, on x already cast to the layer's dtype."
        assert x.dtype == torch.float16 and x.is_contiguous()
        act = quantize(x.float() * reciprocal(smooth.float()), "int4", torch.float16)
        return act, (x.float() @ lora_down_t.float().T).half()

    monkeypatch.setattr(gemm, "gemm_w4a4", fake_gemm_w4a4)
    monkeypatch.setattr(act_quant, "quantize_lora_down", fake_quantize_lora_down)
    monkeypatch.setattr(W4A4Linear, "why_not_sm90", lambda self, x: None)
    lin, calib, x = outlier_problem()
    layer = W4A4Linear.from_linear(lin, rank=16, fmt="int4", act_sample=calib,
                                   kernel_config={"v1": HopperV1Config, "v2": HopperV2Config}[version](), dtype=torch.float16)
    xb = x.bfloat16()
    y = layer(xb)
    assert layer.last_backend == f"sm90-{version}-promote" and y.dtype == torch.bfloat16
    assert [(c["out_dtype"], c["version"]) for c in calls] == [(torch.float16, version)]   # the layer's dtype
    layer.backend = "reference"
    ref32 = layer(xb.float())
    assert layer.last_backend == "reference"
    assert torch.equal(calls[0]["y32"], ref32)
    assert torch.equal(y, ref32.half().bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("fmt, backend", [(None, "sm90-v2-rs"), ("int4", "sm90-v2-promote")])
def test_sm90_backend_matches_reference(fmt, backend):
    "The default format (int4_pg) and int4 each run their format's default kernel, close to the reference path."
    lin, calib, x = outlier_problem(K=1024, N=512, tokens=256)
    layer = W4A4Linear.from_linear(lin.cuda(), rank=32, act_sample=calib.cuda(), **({} if fmt is None else dict(fmt=fmt)))
    x = x.cuda().bfloat16()
    y = layer(x)
    assert layer.last_backend == backend
    layer.backend = "reference"
    ref = layer(x)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
def test_sm90_forward_replays_as_a_cuda_graph():
    "The sm90 forward (fused activation kernel + v2) is capturable: a replay gives the eager output, bit for bit."
    from w4a4_book.bench.timing import cuda_graph
    lin, calib, x = outlier_problem(K=1024, N=512, tokens=256)
    layer = W4A4Linear.from_linear(lin.cuda(), rank=32, act_sample=calib.cuda())
    x = x.cuda().bfloat16()
    eager, out = layer(x), {}
    replay = cuda_graph(lambda: out.__setitem__("y", layer(x)))
    out["y"].zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out["y"], eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("act_fmt", ["int4", "int4_pg", "int8"])
def test_activation_kernel_follows_in_place_writes(act_fmt):
    """The activation kernel's cached per-layer arguments (1/smooth, lora_downᵀ and their launch arguments): a second
    call, a call after in-place writes and one on a copied layer each equal `quantize` of the current values, bit for bit."""
    import copy
    from w4a4_book import ops
    lin, calib, x = outlier_problem(K=1024, N=512, tokens=300)
    layer = W4A4Linear.from_linear(lin.cuda(), rank=32, fmt="int4" if act_fmt == "int4" else "int4_pg", act_sample=calib.cuda())
    x = x.cuda().bfloat16()
    def exact(lyr):
        act, lora_act = ops.quantize_act_sm90(x, lyr.smooth, lyr.lora_down, act_fmt)
        ref = quantize(x.float() * reciprocal(lyr.smooth.float()), act_fmt, torch.bfloat16 if act_fmt == "int4" else None)
        ref = ref.as_int8() if act_fmt == "int4_pg" else ref
        # the kernel's int8 operand carries codes and base (int4_pg) or codes and scales (int4, int8): compare what it has
        have = [f for f in ("scales", "base") if getattr(act, f) is not None]
        assert have and torch.equal(act.data, ref.data) and all(torch.equal(getattr(act, f), getattr(ref, f)) for f in have)
        return lora_act
    first = exact(layer)
    assert torch.equal(exact(layer), first)
    with torch.no_grad():
        layer.smooth.mul_(1.5)
        layer.lora_down.neg_()                       # exact: the LoRA product is negated, bit for bit
    assert torch.equal(exact(layer), -first)
    assert torch.equal(exact(copy.deepcopy(layer)), -first)


# ---------------------------------------------------------------------------------------------
# Bad input

LIN = nn.Linear(256, 64)


@pytest.mark.parametrize("make,exc,msg", [
    (lambda: W4A4Linear.from_linear(LIN.weight), TypeError, "linear must be a torch.nn.Linear"),
    (lambda: W4A4Linear.from_linear(LIN, rank=24), ValueError, "rank=24 must be 0 or a positive multiple of 16"),
    (lambda: W4A4Linear.from_linear(LIN, rank=-16), ValueError, "rank=-16"),
    (lambda: W4A4Linear.from_linear(LIN, rank=16.0), TypeError, "rank: must be an int"),
    (lambda: W4A4Linear.from_linear(LIN, rank=True), TypeError, "rank: must be an int"),
    (lambda: W4A4Linear.from_linear(LIN, rank=128), ValueError, "rank=128 exceeds"),
    (lambda: W4A4Linear.from_linear(LIN, fmt="fp4"), ValueError, "fmt='fp4'"),
    (lambda: W4A4Linear.from_linear(LIN, fmt=None), TypeError, "fmt must be a str"),
    (lambda: W4A4Linear.from_linear(nn.Linear(200, 64), rank=16), ValueError,
     "in_features=200 is not a multiple of the int4_pg group size 64"),
    (lambda: W4A4Linear.from_linear(nn.Linear(40, 64), rank=16, fmt="nvfp4"), ValueError,
     "in_features=40 is not a multiple of the nvfp4 group size 16"),
    (lambda: W4A4Linear.from_linear(LIN, act_sample=torch.randn(4, 64)), ValueError,
     "act_sample must have last dimension K=256"),
    (lambda: W4A4Linear.from_linear(LIN, act_sample=torch.ones(4, 256, dtype=torch.int8)), TypeError,
     "act_sample must be a floating-point"),
    (lambda: W4A4Linear.from_linear(LIN, act_sample=torch.randn(4, 256), alpha=1.5), ValueError, "alpha=1.5"),
    (lambda: W4A4Linear.from_linear(LIN, dtype=torch.float32), ValueError, "dtype=torch.float32"),
    (lambda: W4A4Linear.from_linear(LIN, backend="cuda"), ValueError, "backend='cuda'"),
    (lambda: W4A4Linear.from_linear(LIN, kernel_config="v9"), TypeError, "config: expected one of"),
    (lambda: W4A4Linear(256, 128, kernel_config=HopperV2Config()), ValueError, "kernel_config: HopperV2Config is a kernel for 'int4' weights, but fmt='int4_pg'"),
    (lambda: W4A4Linear(0, 64, rank=0), ValueError, "in_features=0"),
    (lambda: W4A4Linear(256, 64.0), TypeError, "out_features: must be an int"),
])
def test_bad_construction(make, exc, msg):
    with pytest.raises(exc, match=msg):
        make()


LAYER = W4A4Linear(256, 64, rank=16)


@pytest.mark.parametrize("x,exc,msg", [
    (torch.randn(4, 128), ValueError, "x must have last dimension in_features=256"),
    (torch.tensor(1.0), ValueError, "x must have last dimension"),
    (torch.randn(4, 256).double(), TypeError, "x must have dtype"),
    (torch.ones(4, 256, dtype=torch.int32), TypeError, "x must have dtype"),
    ([[0.0] * 256], TypeError, "x must be a torch.Tensor"),
    (torch.randn(4, 256, device="meta"), ValueError, "x is on meta but the layer is on cpu"),
])
def test_bad_forward_input(x, exc, msg):
    with pytest.raises(exc, match=msg):
        LAYER(x)


# ---------------------------------------------------------------------------------------------
# int4_pg weights, W4A8 activations, conversion


@pytest.mark.parametrize("act_fmt", [None, "int8"])
def test_int4_pg_layer_is_the_reference_operator(act_fmt):
    lin, calib, x = outlier_problem()
    layer = W4A4Linear.from_linear(lin, rank=16, fmt="int4_pg", act_sample=calib, act_fmt=act_fmt)
    sd = layer.state_dict()
    assert sd["qweight_scales"].dtype == torch.uint8 and sd["qweight_base"].shape == (128,)
    assert int(sd["qweight_scales"].min()) >= 1 and int(sd["qweight_scales"].max()) <= 15
    act = quantize(x.float() * reciprocal(layer.smooth.float()), act_fmt or "int4_pg")
    lora_act = (x @ layer.lora_down.float()).bfloat16()
    expected = w4a4_gemm_ref(act, layer.qweight, lora_act, layer.lora_up, layer.wcscales, layer.bias)
    assert torch.equal(layer(x), expected) and layer.last_backend == "reference"
    b = W4A4Linear(256, 128, rank=16, fmt="int4_pg", act_fmt=act_fmt)
    b.load_state_dict(sd)
    assert torch.equal(b(x), layer(x))


def test_int4_pg_error_is_close_to_int4_and_w4a8_is_better():
    lin, calib, x = outlier_problem()
    errs = {(f, a): rel_err(W4A4Linear.from_linear(lin, rank=32, fmt=f, act_sample=calib, act_fmt=a), lin, x)
            for f, a in (("int4", None), ("int4_pg", None), ("int4_pg", "int8"))}
    assert errs["int4_pg", None] < 1.1 * errs["int4", None], errs
    assert errs["int4_pg", "int8"] < errs["int4_pg", None], errs


def test_int4_layer_converts_to_int4_pg():
    lin, calib, x = outlier_problem()
    int4 = W4A4Linear.from_linear(lin, rank=32, fmt="int4", act_sample=calib)
    pg = int4.to_int4_pg()
    assert pg.fmt == "int4_pg" and torch.equal(pg.lora_up, int4.lora_up) and torch.equal(pg.smooth, int4.smooth)
    assert rel_err(pg, lin, x) < 1.1 * rel_err(int4, lin, x)
    with pytest.raises(ValueError, match="fmt='int4_pg': to_int4_pg converts an int4 layer"):
        pg.to_int4_pg()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("act_fmt", [None, "int8"])
def test_int4_pg_layer_runs_the_exact_integer_kernel(act_fmt):
    "fmt=int4_pg on an sm_90 GPU: the two-pass activation kernel, then the exact-integer GEMM; equal to the reference path."
    lin, calib, x = outlier_problem(K=1024, N=512, tokens=300)
    layer = W4A4Linear.from_linear(lin.cuda(), rank=32, fmt="int4_pg", act_sample=calib.cuda(), act_fmt=act_fmt)
    x = x.cuda().bfloat16()
    y = layer(x)
    assert layer.last_backend == "sm90-v2-rs"
    layer.backend = "reference"
    ref = layer(x)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_quantize_model_replaces_nested_layers_like_from_linear():
    "Nested linears are replaced where they sit, each exactly as `from_linear` converts it alone."
    from w4a4_book.layers import quantize_model
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(128, 256))])})
    alone = W4A4Linear.from_linear(model["blocks"][0][0], 16, "int4_pg")
    quantize_model(model, "int4_pg", 16, quiet=True)
    got = model["blocks"][0][0]
    assert model.w4a4_conversion.converted == ["blocks.0.0"] and isinstance(got, W4A4Linear)
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    assert torch.equal(got(x), alone(x))


# ---------------------------------------------------------------------------------------------
# Casts


ALL_FORMATS = ("int4", "int4_pg", "nvfp4")


def cast_model(fmt, with_float=False):
    "A small model of two converted linears around a GELU, and a float input (and the float model)."
    torch.manual_seed(0)
    from w4a4_book.layers import quantize_model
    float_model = nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 256))
    model = quantize_model(copy.deepcopy(float_model), fmt=fmt, rank=16, calibration=[torch.randn(16, 256)], quiet=True)
    return (model, torch.randn(4, 256)) + ((float_model,) if with_float else ())


def dtypes(model):
    return {k: v.dtype for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("cast, want", [
    (lambda m: m.to(torch.float16), torch.float16), (lambda m: m.half(), torch.float16),
    (lambda m: m.to(torch.bfloat16), torch.bfloat16), (lambda m: m.half().bfloat16(), torch.bfloat16),
    (lambda m: m.to("cpu", torch.float16), torch.float16), (lambda m: m.to(torch.zeros(1, dtype=torch.float16)), torch.float16),
])
def test_a_whole_model_casts_to_a_16_bit_dtype(fmt, cast, want):
    "The 16-bit buffers and `dtype` follow; the codes, FP8 scales and float32 bases keep their dtypes; the model runs."
    model, x, float_model = cast_model(fmt, with_float=True)
    before = dtypes(model)
    with torch.no_grad():
        ref = float_model(x)
    err = lambda y: ((y.float() - ref).norm() / ref.norm()).item()
    y0 = model(x)
    cast(model)
    for layer in (model[0], model[2]):
        assert layer.dtype == want and layer.lora_up.dtype == want and layer.smooth.dtype == want
        assert layer.qweight_scales.dtype == (want if fmt == "int4" else before["0.qweight_scales"])
    assert all(d == (want if before[k] == torch.bfloat16 else before[k]) for k, d in dtypes(model).items())
    y = model(x.to(want))
    assert y.dtype == want and torch.isfinite(y).all()
    assert err(y) < err(y0) + 0.05                             # as accurate, up to the 16-bit input's rounding


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("cast", [lambda m: m.float(), lambda m: m.to(torch.float32), lambda m: m.double(),
                                  lambda m: m.type(torch.float64)])
def test_a_cast_the_layer_cannot_take_warns_once_and_changes_nothing(fmt, cast):
    model, x = cast_model(fmt)
    before, y0 = dtypes(model), model(x)
    with pytest.warns(UserWarning, match=r"W4A4Linear '?0'? \(and any other W4A4Linear of this cast\) keeps dtype "
                                         r"torch.bfloat16") as caught:
        cast(model)
    assert len([w for w in caught if "keeps dtype" in str(w.message)]) == 1      # once per cast, naming the first layer
    assert dtypes(model) == before and model[0].dtype == torch.bfloat16
    assert torch.equal(model(x), y0)


def test_a_cast_that_would_overflow_keeps_the_layer():
    model, x = cast_model("int4_pg")
    with torch.no_grad():
        model[2].lora_up[0, 0] = 1e6                          # beyond float16's largest finite value
    with pytest.warns(UserWarning, match="W4A4Linear 2 .* keeps dtype torch.bfloat16 rather than torch.float16: "
                                         "lora_up would not be finite"):
        model.half()
    assert (model[0].dtype, model[2].dtype) == (torch.float16, torch.bfloat16)
    assert model(x.half()).dtype == torch.float16


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_device_moves_keep_every_dtype(fmt):
    model, x = cast_model(fmt)
    before, y0 = dtypes(model), model(x)
    assert torch.equal(model.to("cpu")(x), y0) and dtypes(model) == before
    meta = copy.deepcopy(model).to("meta")
    assert dtypes(meta) == before and {t.device.type for t in meta.state_dict().values()} == {"meta"}
    empty = meta.to_empty(device="cpu")
    assert dtypes(empty) == before


# ---------------------------------------------------------------------------------------------
# Every nn.Linear of a model: subclasses, attention, torch's transformer layers


def linear_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def accounted(model_before, report):
    "Every linear of the model before conversion is converted or skipped, by its full name."
    names = set(report.converted) | {n for n, _ in report.skipped}
    return [n for n in linear_names(model_before) if n not in names]


class Scaled(nn.Linear):
    "A subclass with a forward of its own, which a conversion would drop."
    def forward(self, x):
        return 2 * super().forward(x)


class Plain(nn.Linear):
    "A subclass that adds nothing to the computation."


def test_subclasses_are_converted_or_reported():
    from w4a4_book.layers import quantize_model
    model = nn.Sequential(Plain(256, 128), Scaled(128, 128), nn.LazyLinear(64))
    report = quantize_model(copy.deepcopy(model), rank=16, quiet=True).w4a4_conversion
    assert report.converted == ["0"]
    assert dict(report.skipped) == {
        "1": "Scaled subclasses nn.Linear with a forward of its own, which a conversion would drop",
        "2": "LazyLinear is not initialised yet (a lazy module): run the model once before converting it"}


@pytest.mark.parametrize("make", [
    lambda: nn.TransformerEncoderLayer(512, 8, 2048),
    lambda: nn.TransformerEncoderLayer(256, 4, 512, batch_first=True, norm_first=True),
    lambda: nn.TransformerDecoderLayer(256, 4, 512, batch_first=True),
    lambda: nn.Transformer(128, 4, 2, 2, 256, batch_first=True),
])
def test_torch_transformer_layers_convert_and_run(make):
    "Every linear converted or reported; eval forward (the fast paths off where they would read a weight) and train."
    from w4a4_book.layers import quantize_model
    torch.manual_seed(0)
    model = make().eval()
    before = copy.deepcopy(model)
    quantize_model(model, rank=16, quiet=True)
    assert accounted(before, model.w4a4_conversion) == []
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    first = getattr(model, "batch_first", None) or getattr(getattr(model, "self_attn", None), "batch_first", True)
    d = model.d_model if hasattr(model, "d_model") else before.linear1.in_features
    x = torch.randn(2, 6, d) if first else torch.randn(6, 2, d)
    args = (x, x) if isinstance(model, (nn.TransformerDecoderLayer, nn.Transformer)) else (x,)
    with torch.no_grad():
        y_float, y = before(*args), model(*args)
    assert y.shape == y_float.shape and ((y - y_float).norm() / y_float.norm()).item() < 0.2
    model.train()
    x.requires_grad_()
    model(*args).square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_encoder_fast_path_and_nested_tensor_path_are_off():
    "The encoder layer's fast path (eval, batch_first, no grad) and the encoder's nested path both read the weights."
    from w4a4_book.layers import quantize_model
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, 512, batch_first=True), 2, enable_nested_tensor=True)
    enc.eval()
    assert enc.use_nested_tensor
    before = copy.deepcopy(enc)
    quantize_model(enc, rank=16, quiet=True)
    report = enc.w4a4_conversion
    assert [n for n, _ in report.adapted] == ["", "layers.0", "layers.0.self_attn", "layers.1", "layers.1.self_attn"]
    x, pad = torch.randn(2, 8, 256), torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 6:] = True
    with torch.no_grad():
        y, y_float = enc(x, src_key_padding_mask=pad), before(x, src_key_padding_mask=pad)
    keep = ~pad
    assert ((y - y_float)[keep].norm() / y_float[keep].norm()).item() < 0.2
    assert not enc.use_nested_tensor
    assert "fast path off" in str(report) and "use_nested_tensor off" in str(report)


def test_multihead_attention_split_or_reported():
    from w4a4_book.layers import quantize_model, SplitMultiheadAttention
    model = nn.ModuleDict({"a": nn.MultiheadAttention(128, 4), "b": nn.MultiheadAttention(128, 4, add_bias_kv=True),
                           "c": nn.MultiheadAttention(96, 4), "d": nn.MultiheadAttention(128, 4)})
    quantize_model(model, rank=16, filter=lambda name, lin: not name.startswith("d."), quiet=True)
    report = model.w4a4_conversion
    assert report.converted == ["a.q_proj", "a.k_proj", "a.v_proj", "a.out_proj"]
    skipped = dict(report.skipped)
    assert skipped["b.out_proj"].startswith("kept in its nn.MultiheadAttention with add_bias_kv=True")
    assert skipped["c.out_proj"].startswith("kept in its nn.MultiheadAttention, no projection converts: in_features")
    assert skipped["d.out_proj"] == "kept in its nn.MultiheadAttention, no projection converts: rejected by filter"
    assert isinstance(model["a"], SplitMultiheadAttention)
    assert all(type(model[k]) is nn.MultiheadAttention for k in "bcd")       # kept whole, with their fast path
    with pytest.raises(TypeError, match="model: is itself an nn.MultiheadAttention, which quantize_model can't replace"):
        quantize_model(nn.MultiheadAttention(128, 4))


@pytest.mark.parametrize("opts", [dict(), dict(batch_first=True), dict(bias=False), dict(kdim=64, vdim=96),
                                  dict(dropout=0.1)])
@pytest.mark.parametrize("train", [False, True])
def test_split_attention_is_the_attention(opts, train):
    "Outputs, weights and gradients of nn.MultiheadAttention, for each way of calling it."
    from w4a4_book.layers import SplitMultiheadAttention
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4, **opts).train(train and not opts.get("dropout"))
    split = SplitMultiheadAttention(mha)
    assert split.training == mha.training
    bf = opts.get("batch_first", False)
    q = torch.randn(2, 5, 64) if bf else torch.randn(5, 2, 64)
    kv = torch.randn(2, 7, 96) if bf else torch.randn(7, 2, 96)
    k, v = kv[..., :opts.get("kdim", 64)], kv[..., :opts.get("vdim", 64)]
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, -3:] = True
    mask = torch.randn(5, 7)
    calls = [dict(), dict(need_weights=False), dict(average_attn_weights=False), dict(key_padding_mask=pad),
             dict(attn_mask=mask), dict(attn_mask=mask > 1, key_padding_mask=pad, need_weights=False),
             dict(attn_mask=torch.randn(8, 5, 7))]
    for kw in calls:
        qa = q.clone().requires_grad_()
        want = mha(qa, k, v, **kw)
        qb = q.clone().requires_grad_()
        got = split(qb, k, v, **kw)
        assert torch.allclose(got[0], want[0], atol=1e-5), kw
        assert (got[1] is None) == (want[1] is None) and (got[1] is None or torch.allclose(got[1], want[1], atol=1e-6))
        want[0].sum().backward()
        got[0].sum().backward()
        assert torch.allclose(qa.grad, qb.grad, atol=1e-5), kw
    if not opts.get("kdim"):
        u = q[0] if bf else q[:, 0]                                   # an unbatched input, [L, E]
        assert torch.allclose(split(u, u, u)[0], mha(u, u, u)[0], atol=1e-5)


def test_split_attention_in_training_with_dropout_runs():
    from w4a4_book.layers import SplitMultiheadAttention
    split = SplitMultiheadAttention(nn.MultiheadAttention(64, 4, dropout=0.5)).train()
    x = torch.randn(5, 2, 64)
    out, w = split(x, x, x)
    assert out.shape == (5, 2, 64) and w.shape == (2, 5, 5)


def test_conversion_leaves_the_global_random_state_alone():
    from w4a4_book.layers import quantize_model
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(512, 8, 1024), nn.Linear(512, 1024))
    state = torch.get_rng_state()
    quantize_model(model, rank=32, quiet=True)                # a split attention, randomized SVDs
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------------------------------------
# Saving and loading: all or nothing


def saved_model(tmp_path, name="m.pt"):
    from w4a4_book.layers import quantize_model, save_quantized
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(256, 256), nn.TransformerEncoderLayer(256, 4, 512, batch_first=True))
    model = quantize_model(make().eval(), rank=16, quiet=True)
    save_quantized(model, tmp_path / name)
    return model, make, tmp_path / name


def state_of(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["m.pt", "m.safetensors"])
def test_load_round_trip_with_a_split_attention(tmp_path, name):
    from w4a4_book.layers import load_quantized
    model, make, path = saved_model(tmp_path, name)
    torch.manual_seed(1)
    loaded = load_quantized(make().eval(), path)
    x = torch.randn(2, 5, 256)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert loaded[0].layer_name == "0" and loaded[1].self_attn.q_proj.layer_name == "1.self_attn.q_proj"


@pytest.mark.parametrize("change, msg", [
    (lambda m: m.append(nn.LayerNorm(256)), "does not match model: it lacks '2.weight'"),
    (lambda m: setattr(m[1], "norm2", nn.LayerNorm(128)), "'1.norm2.weight' has shape \\(256,\\) there, \\(128,\\) in model"),
    (lambda m: setattr(m[1], "norm2", nn.Identity()), "it holds '1.norm2.weight', which model has not"),
    (lambda m: setattr(m[1], "linear1", nn.Linear(256, 256)), "model: '1.linear1' is not an nn.Linear\\(256, 512\\)"),
    (lambda m: setattr(m[1], "self_attn", nn.MultiheadAttention(256, 4, add_bias_kv=True)),
     "model: '1.self_attn' is an nn.MultiheadAttention with add_bias_kv=True"),
])
def test_a_load_that_does_not_match_leaves_the_model_as_it_was(tmp_path, change, msg):
    from w4a4_book.layers import load_quantized
    _, make, path = saved_model(tmp_path)
    target = make()
    change(target)
    before, kinds = state_of(target), [type(m) for m in target.modules()]
    with pytest.raises(ValueError, match=msg):
        load_quantized(target, path)
    assert [type(m) for m in target.modules()] == kinds
    assert state_of(target).keys() == before.keys() and all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


# ---------------------------------------------------------------------------------------------
# Named errors of the layer functions, each raised before any work


def _nan_linear(value):
    lin = nn.Linear(256, 128)
    with torch.no_grad():
        lin.weight[1, 2] = value
    return lin


def _errors(tmp_path):
    from w4a4_book.layers import load_quantized, quantize_model, save_quantized
    converted = quantize_model(nn.Sequential(nn.Linear(256, 128)), rank=16, quiet=True)
    good = tmp_path / "good.pt"
    save_quantized(converted, good)
    (tmp_path / "a_file").write_text("")
    seq = lambda lin: nn.Sequential(nn.Linear(128, 256), lin)
    return [
        (lambda: W4A4Linear.from_linear("linear"), TypeError, "linear must be a torch.nn.Linear, not str"),
        (lambda: W4A4Linear.from_linear(_nan_linear(float("nan"))), ValueError, "linear: weight holds 1 NaN of 32768 values"),
        (lambda: W4A4Linear.from_linear(_nan_linear(float("inf"))), ValueError, "linear: weight holds 1 inf of 32768 values"),
        (lambda: W4A4Linear.from_linear(LIN, act_sample=torch.full((2, 256), float("nan"))), ValueError,
         "act_sample: holds 512 NaN"),
        (lambda: W4A4Linear.from_linear(LIN, rank=16, low_rank_method="qr"), ValueError, "low_rank_method: 'qr' must be one of"),
        (lambda: W4A4Linear.from_linear(nn.Linear(200, 64), rank=16), ValueError, "in_features: in_features=200 is not a multiple"),
        (lambda: W4A4Linear.from_linear(LIN, fmt="fp8"), ValueError, "fmt='fp8' is not a known format"),
        (lambda: W4A4Linear.from_linear(LIN, rank=-16), ValueError, "rank: rank=-16 must be 0 or a positive multiple"),
        (lambda: low_rank(torch.randn(64, 32), -1), ValueError, "rank: rank=-1 must lie in \\[0, min\\(N, K\\)\\] = \\[0, 32\\]"),
        (lambda: low_rank(torch.randn(64, 32), 8, method="qr"), ValueError, "method: 'qr' must be one of"),
        (lambda: low_rank(torch.full((64, 32), float("nan")), 8), ValueError, "w: holds 2048 NaN"),
        (lambda: low_rank(torch.ones(64), 8), TypeError, "w: must be a 2-D floating-point torch.Tensor"),
        (lambda: quantize_model("model"), TypeError, "model must be a torch.nn.Module, not str"),
        (lambda: quantize_model(nn.Linear(256, 64)), TypeError, "model: is itself an nn.Linear"),
        (lambda: quantize_model(seq(_nan_linear(float("nan")))), ValueError, "model: 1.weight holds 1 NaN of 32768 values"),
        (lambda: quantize_model(seq(_nan_linear(float("-inf")))), ValueError, "model: 1.weight holds 1 inf"),
        (lambda: quantize_model(seq(nn.Linear(256, 64)), fmt="fp4"), ValueError, "fmt='fp4' is not a known format"),
        (lambda: quantize_model(seq(nn.Linear(256, 64)), rank=-16), ValueError, "rank: rank=-16"),
        (lambda: quantize_model(seq(nn.Linear(256, 64)), rank="32"), TypeError, "rank: must be an int, not str"),
        (lambda: quantize_model(seq(nn.Linear(256, 64)), dtype=torch.float32), ValueError, "dtype: dtype=torch.float32"),
        (lambda: quantize_model(seq(nn.Linear(256, 64)), alpha=2.0), ValueError, "alpha: 2.0 must lie in \\[0, 1\\]"),
        (lambda: quantize_model(seq(nn.Linear(256, 64)), calibration=5), TypeError,
         "calibration: must be an iterable of batches .*not int"),
        (lambda: quantize_model(seq(nn.Linear(256, 64)), calibration=torch.randn(4, 128)), TypeError,
         "calibration: .*not Tensor; for one batch pass \\[x\\]"),
        (lambda: quantize_model(seq(nn.Linear(256, 64)), calibration=[torch.full((4, 128), float("inf"))]), ValueError,
         "calibration: the inputs of '0' are not finite"),
        (lambda: quantize_model(seq(nn.Linear(256, 64)), filter="0"), TypeError, "filter must be callable"),
        (lambda: quantize_model(nn.Sequential(nn.Linear(100, 64)), quiet=True), ValueError,
         "model: no nn.Linear to convert \\(1 skipped: 0: in_features"),
        (lambda: save_quantized("model", tmp_path / "x.pt"), TypeError, "model: must be a torch.nn.Module, not str"),
        (lambda: save_quantized(converted, tmp_path / "no" / "x.pt"), FileNotFoundError, "path: folder .* does not exist"),
        (lambda: save_quantized(converted, tmp_path / "a_file" / "x.pt"), FileNotFoundError, "path: folder .*a_file' does not"),
        (lambda: save_quantized(converted, tmp_path), IsADirectoryError, "path: .* is a folder; name a file in it"),
        (lambda: save_quantized(converted, 3), TypeError, "path: must be a str or an os.PathLike, not int"),
        (lambda: load_quantized("x", good), TypeError, "model: must be a torch.nn.Module, not str"),
        (lambda: load_quantized(nn.Sequential(nn.Linear(256, 128)), tmp_path / "missing.pt"), FileNotFoundError,
         "path: no file at"),
        (lambda: load_quantized(nn.Sequential(nn.Linear(256, 64)), good), ValueError,
         "model: '0' is not an nn.Linear\\(256, 128\\)"),
    ]


def test_named_errors(tmp_path):
    "Each call fails with one line that names the argument."
    for call, exc, msg in _errors(tmp_path):
        with pytest.raises(exc, match=msg) as info:
            call()
        assert "\n" not in str(info.value), str(info.value)


def test_a_weight_that_is_not_finite_is_found_before_any_change():
    from w4a4_book.layers import quantize_model
    model = nn.Sequential(nn.TransformerEncoderLayer(128, 4, 256), nn.Linear(128, 128))
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="model: 1.weight holds 1 NaN of 16384 values"):
        quantize_model(model, rank=16)
    assert [type(m) for m in model.modules()] == before           # the attention not split, no layer converted


def test_a_root_attention_loads_into_its_split(tmp_path):
    from w4a4_book.layers import SplitMultiheadAttention, load_quantized, quantize_model, save_quantized
    torch.manual_seed(0)
    att = quantize_model(SplitMultiheadAttention(nn.MultiheadAttention(128, 4)), rank=16, quiet=True)
    save_quantized(att, tmp_path / "a.pt")
    with pytest.raises(TypeError, match="model: is itself an nn.MultiheadAttention; load into SplitMultiheadAttention"):
        load_quantized(nn.MultiheadAttention(128, 4), tmp_path / "a.pt")
    loaded = load_quantized(SplitMultiheadAttention(nn.MultiheadAttention(128, 4)), tmp_path / "a.pt")
    x = torch.randn(5, 2, 128)
    with torch.no_grad():
        assert torch.equal(loaded(x, x, x)[0], att(x, x, x)[0])


def test_unwritable_path(tmp_path, monkeypatch):
    from w4a4_book.layers import quantize_model, save_quantized
    import os
    converted = quantize_model(nn.Sequential(nn.Linear(256, 128)), rank=16, quiet=True)
    monkeypatch.setattr(os, "access", lambda path, mode: False)      # as for a user without write permission
    with pytest.raises(PermissionError, match="path: .* cannot be written"):
        save_quantized(converted, tmp_path / "x.pt")


def test_a_failed_calibration_puts_the_model_back():
    from w4a4_book.layers import quantize_model
    model = nn.Sequential(nn.TransformerEncoderLayer(128, 4, 256))
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(RuntimeError):
        quantize_model(model, rank=16, calibration=[torch.randn(3, 2, 64)], quiet=True)    # the wrong width
    assert [type(m) for m in model.modules()] == kinds


def test_empty_name_is_never_printed():
    from w4a4_book.layers import ConversionReport
    assert "adapted (the model): x" in str(ConversionReport(["a"], [], False, [("", "x")]))


# ---------------------------------------------------------------------------------------------
# The low-rank factors: a randomized SVD where it matches the full one


def _outlier_weights(N, K, seed):
    "Weights of the kinds the layer chapter measured on, at another shape and seed: smoothed, and Gaussian with spikes."
    from w4a4_book import accuracy
    w = accuracy.weights(N, K, seed)
    g = torch.Generator().manual_seed(seed)
    spiky = torch.randn(N, K, generator=g) / K**0.5
    spiky[:, :4] *= 8
    return {"outlier channels": w * smooth_factors(accuracy.activations("outlier_channels", 256, K, seed), w),
            "llm_like": w * smooth_factors(accuracy.activations("llm_like", 256, K, seed), w), "spiky": spiky}


@pytest.mark.parametrize("shape", [(512, 1024), (1024, 512)])
def test_randomized_svd_matches_the_full_one_within_the_tolerance(shape):
    from w4a4_book.layers import RSVD_TOLERANCE, randomized_low_rank
    for kind, w in _outlier_weights(*shape, seed=3).items():
        U, S, Vh = torch.linalg.svd(w, full_matrices=False)
        for rank in (16, 32, 64):
            best = (w - (U[:, :rank] * S[:rank]) @ Vh[:rank]).norm()
            up, down = low_rank(w, rank)                          # "auto": randomized at these shapes
            assert torch.equal(up, randomized_low_rank(w, rank)[0])
            assert (w - up @ down.T).norm() / best - 1 < RSVD_TOLERANCE, (kind, rank)


def test_low_rank_chooses_by_shape_and_is_reproducible():
    from w4a4_book.layers import randomized_low_rank
    small, w = torch.randn(256, 1024), torch.randn(600, 700)
    state = torch.get_rng_state()
    assert torch.equal(low_rank(small, 32)[0], low_rank(small, 32, "svd")[0])       # min(N, K) < 512: the full SVD
    assert torch.equal(low_rank(w, 64)[0], randomized_low_rank(w, 64)[0])          # 600 >= 4 * 2 * 64: randomized
    assert torch.equal(low_rank(w, 80)[0], low_rank(w, 80, "svd")[0])              # 600 < 4 * 2 * 80: the full SVD
    assert torch.equal(low_rank(w, 64)[0], low_rank(w, 64)[0])                     # the same factors each time
    assert torch.equal(torch.get_rng_state(), state)                               # and no global draw
    up, down = low_rank(w, 0)
    assert up.shape == (600, 0) and down.shape == (700, 0)
