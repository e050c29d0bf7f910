"Tests of `W4A4Linear`: SVDQuant conversion, forward pass, backend dispatch and argument checks."
import types

import pytest
import torch
from torch import nn

from w4a4_book.formats import dequantize, quantize, reciprocal
from w4a4_book.layers import W4A4Linear, low_rank, smooth_factors
from w4a4_book.reference import w4a4_gemm_ref
from w4a4_book import gemm
from w4a4_book.smem import HopperV1Config, HopperV2Config

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
        calls.append(dict(out_dtype=out_dtype, version=gemm.spec_for(config).kernel, y32=y32))
        return y32.to(out_dtype)

    def fake_quantize_lora_down(x, smooth, lora_down_t, fmt):
        "What the fused kernel computes, by the reference rules, on x already cast to the layer's dtype."
        assert x.dtype == torch.float16 and x.is_contiguous()
        act = quantize(x.float() * reciprocal(smooth.float()), "int4", torch.float16)
        return act, (x.float() @ lora_down_t.float().T).half()

    monkeypatch.setattr(gemm, "gemm_w4a4", fake_gemm_w4a4)
    monkeypatch.setattr(gemm, "quantize_lora_down", fake_quantize_lora_down)
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
