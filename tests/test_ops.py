"Tests of `w4a4::linear`: opcheck, torch.compile without graph breaks, CUDA-graph capture, and the named errors of bad input."
import copy
import pickle

import pytest
import torch
from torch import nn

from w4a4_book import act_quant, cache, jit, ops, registry
from w4a4_book.layers import W4A4Linear, quantize_model, save_quantized
from w4a4_book.reference import w4a4_gemm_ref
from w4a4_book.configs import HopperV2Config

PAIRS = [("int4", None), ("nvfp4", None), ("int4_pg", None), ("int4_pg", "int8")]
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
SM90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs an sm_90 GPU")


def converted(fmt="int4_pg", act_fmt=None, K=256, N=128, rank=16, seed=0):
    "A converted layer with smoothing from a calibration batch, and a batch of rows for it."
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N)
    x = torch.randn(8, K, generator=g)
    x[:, 3] *= 20
    return W4A4Linear.from_linear(lin, rank=rank, fmt=fmt, act_sample=x, act_fmt=act_fmt), torch.randn(8, K, generator=g)


def block(K=256, H=512, device="cpu", **kw):
    "Two converted linears around a ReLU (exact in every backend, so a compiled block can equal the eager one bit for bit)."
    torch.manual_seed(0)
    return quantize_model(nn.Sequential(nn.Linear(K, H), nn.ReLU(), nn.Linear(H, K)).to(device), rank=16, quiet=True, **kw)


# ---------------------------------------------------------------------------------------------
# The op


@pytest.mark.parametrize("fmt, act_fmt", PAIRS)
def test_op_reference_is_the_reference_operator(fmt, act_fmt):
    layer, x32 = converted(fmt, act_fmt)
    for x in (x32, x32.bfloat16()):
        act, lora_act = ops.quantize_act_ref(x, layer.smooth, layer.lora_down, layer.act_fmt)
        want = w4a4_gemm_ref(act, layer.qweight, lora_act, layer.lora_up, layer.wcscales, layer.bias).to(x.dtype)
        for backend in ("reference", "auto"):                   # on a CPU "auto" is the reference
            assert torch.equal(torch.ops.w4a4.linear(*layer.op_args(x, backend)), want)


@pytest.mark.parametrize("fmt, act_fmt", PAIRS)
def test_opcheck(fmt, act_fmt):
    layer, x = converted(fmt, act_fmt)
    # test_schema compares the inputs before and after with allclose, which CPU FP8 (nvfp4's scales) lacks
    tests = [t for t in OPCHECKS if not (fmt == "nvfp4" and t == "test_schema")]
    torch.library.opcheck(torch.ops.w4a4.linear.default, layer.op_args(x), test_utils=tests)
    torch.library.opcheck(torch.ops.w4a4.linear.default, layer.op_args(x[:1].bfloat16()), test_utils=tests)


def test_op_reads_no_input_back_and_mutates_none():
    "The weight values are checked once per buffer version; an in-place write is seen, and a bad value refused by name."
    layer, x = converted("int4_pg")
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    y = layer(x)
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
    with torch.no_grad():
        layer.qweight_scales[0, 0] = 16                         # u out of [1, 15]: the version counter moves
    with pytest.raises(ValueError, match=r"scales \(u\) must lie in \[1, 15\]"):
        layer(x)
    with torch.no_grad():
        layer.qweight_scales.copy_(before["qweight_scales"])
    assert torch.equal(layer(x), y)


def test_a_layer_made_under_inference_mode():
    "Inference tensors have no version counter: nothing is cached for them, and a bad value is still refused."
    with torch.inference_mode():
        layer, x = converted("int4_pg")
        y = layer(x)
        assert torch.equal(layer(x), y) and torch.equal(torch.compile(layer, fullgraph=True, backend="eager")(x), y)
        assert torch.equal(ops.lora_down_t(layer.lora_down), layer.lora_down.t())
        layer.qweight_scales[0, 0] = 0
        with pytest.raises(ValueError, match=r"scales \(u\) must lie in \[1, 15\]"):
            layer(x)


def test_kernel_config_is_registered_with_the_op():
    layer = W4A4Linear(512, 256, rank=16, fmt="int4", kernel_config=HopperV2Config(cluster_n=2))
    key = layer.op_args(torch.zeros(1, 512))[-1]
    assert ops.config_from_key(key) == HopperV2Config(cluster_n=2)
    ops.config_from_key.cache_clear()                           # as in a fresh process: the key alone rebuilds the config
    assert ops.config_from_key(pickle.loads(pickle.dumps(layer)).op_args(torch.zeros(1, 512))[-1]) == HopperV2Config(cluster_n=2)
    layer.kernel_config = None
    assert layer.op_args(torch.zeros(1, 512))[-1] == ""
    assert copy.deepcopy(layer).kernel_config is None


# ---------------------------------------------------------------------------------------------
# The backward pass


def float_weight(layer):
    """`(W_eff, A)`: the weight of the float layer the op's backward differentiates, `(W/smooth + up @ down.T) * wcscales`
    over the dequantized residual `W`, and the magnitudes of the terms it sums, for the rounding bound."""
    from w4a4_book.formats import dequantize, reciprocal
    W, r = dequantize(layer.qweight), reciprocal(layer.smooth.float())
    up, down, s = layer.lora_up.float(), layer.lora_down.float(), layer.wcscales.float()[:, None]
    return (W * r + up @ down.T) * s, (W.abs() * r.abs() + up.abs() @ down.abs().T) * s.abs()


def rounding_bound(layer, gy, A):
    "Twice gamma_n |g| A with n = N + R + 4 float32 roundings: how far two orders of the same sums may differ."
    return 2 * (layer.out_features + layer.rank + 4) * 2.0**-24 * (gy.abs() @ A)


@pytest.mark.parametrize("fmt, act_fmt", PAIRS)
@pytest.mark.parametrize("rank", [0, 16])
def test_the_input_gradient_is_the_float_layers_over_the_dequantized_weight(fmt, act_fmt, rank):
    import warnings
    layer, _ = converted(fmt, act_fmt, rank=rank)
    w_eff, A = float_weight(layer)
    x = torch.randn(3, 5, 256, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)                  # "an autograd kernel was not registered", say
        y = layer(x)
        gy = torch.randn(y.shape)
        (gx,) = torch.autograd.grad(y, x, gy)
    xf = x.detach().clone().requires_grad_()
    (ref,) = torch.autograd.grad(torch.nn.functional.linear(xf, w_eff), xf, gy)
    assert gx.dtype == x.dtype and ((gx - ref).abs() <= rounding_bound(layer, gy, A)).all()
    cos = torch.nn.functional.cosine_similarity(gx.flatten(), ref.flatten(), 0)
    assert cos > 1 - 1e-6
    xb, gb = x.detach().bfloat16().requires_grad_(), gy.bfloat16()     # bfloat16 in: the same sums, rounded once more
    layer(xb).backward(gb)
    (refb,) = torch.autograd.grad(torch.nn.functional.linear(xf, w_eff), xf, gb.float())
    assert xb.grad.dtype == torch.bfloat16
    assert torch.allclose(xb.grad.float(), refb, rtol=2**-8, atol=float(rounding_bound(layer, gb.float(), A).max()))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_model_differentiates_as_the_eager_one(backend):
    model = block()
    x = torch.randn(4, 256, requires_grad=True)
    gy = torch.randn(4, 256)
    (eager,) = torch.autograd.grad(model(x), x, gy)
    xc = x.detach().clone().requires_grad_()
    (compiled,) = torch.autograd.grad(torch.compile(model, fullgraph=True, backend=backend)(xc), xc, gy)
    assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt, act_fmt", PAIRS)
def test_opcheck_with_an_input_that_requires_grad(fmt, act_fmt):
    layer, x = converted(fmt, act_fmt)
    tests = [t for t in OPCHECKS if not (fmt == "nvfp4" and t == "test_schema")]
    torch.library.opcheck(torch.ops.w4a4.linear.default, layer.op_args(x.requires_grad_()), test_utils=tests)


def test_a_buffer_that_requires_grad_is_refused_by_name():
    layer, x = converted()
    layer.lora_up.requires_grad_()
    with pytest.raises(ValueError, match="lora_up: requires grad, but w4a4::linear differentiates only x"):
        layer(x)
    with torch.no_grad():                                            # nothing to differentiate: it runs
        layer(x)


def test_a_second_derivative_and_a_frozen_input():
    "The backward is made of differentiable ops (a second derivative warns of nothing); no grad asked, none made."
    import warnings
    layer, x = converted()
    x.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        y = layer(x)
        gy = torch.randn(y.shape, requires_grad=True)
        (gx,) = torch.autograd.grad(y, x, gy, create_graph=True)
        (ggy,) = torch.autograd.grad(gx.square().sum(), gy)
    assert ggy.shape == y.shape and torch.isfinite(ggy).all()
    assert layer(x.detach()).grad_fn is None


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("act_fmt", [None, "int8"])
def test_the_sm90_forward_is_differentiable(act_fmt):
    "On the GPU the forward runs the kernels (not the bound path, which autograd cannot see) and the gradient is the CPU's."
    layer, x = converted("int4_pg", act_fmt, K=1024, N=512, rank=32)
    gpu = copy.deepcopy(layer).cuda()
    xg = x.cuda().bfloat16().requires_grad_()
    y = gpu(xg)
    assert gpu.last_backend == "sm90-v2-rs" and y.grad_fn is not None
    gy = torch.randn(y.shape, device="cuda", dtype=y.dtype)
    y.backward(gy)
    xc = x.bfloat16().requires_grad_()
    layer(xc).backward(gy.cpu())
    assert torch.allclose(xg.grad.float().cpu(), xc.grad.float(), rtol=2**-6, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_fullgraph_equals_eager(backend):
    "One graph, no break; the compiled block equals the eager one bit for bit, at a second (dynamic) M too."
    model = block()
    x = torch.randn(4, 32, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        assert torch.equal(compiled(x), model(x))
        x2 = torch.randn(7, 256)
        assert torch.equal(compiled(x2), model(x2))


def test_explain_counts_no_graph_break():
    model = block()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(torch.randn(16, 256, dtype=torch.bfloat16))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert "w4a4.linear" in str(explained.graphs[0].graph)


def test_compiled_calls_leave_last_backend_alone():
    model = block()
    x = torch.randn(16, 256)
    model(x)
    assert [m.last_backend for m in model if isinstance(m, W4A4Linear)] == ["reference", "reference"]
    model[0].last_backend = "set by hand"
    torch.compile(model, fullgraph=True, backend="eager")(x)
    assert model[0].last_backend == "set by hand"


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_op_arguments_are_named():
    layer, x = converted()
    args = layer.op_args(x)
    op = torch.ops.w4a4.linear
    cases = [(0, x.double(), TypeError, "x: must have dtype in"), (0, x[:, :128], ValueError, "x: must be \\[M, K\\] with K=256"),
             (0, x[None], ValueError, "x: must be \\[M, K\\]"),
             (5, layer.smooth.float(), TypeError, "smooth: must have the layer's dtype"),
             (6, None, ValueError, "lora_down: and lora_up must be given together"),
             (9, layer.bias.to("meta"), ValueError, "bias: is on meta, x is on cpu"),
             (10, "fp4", ValueError, "fmt='fp4' is not a known format"),
             (11, "int4", ValueError, "act_fmt: 'int4' cannot pair with fmt='int4_pg'"),
             (12, "cuda", ValueError, "backend: 'cuda' must be one of"),
             (13, "HopperV9Config()", ValueError, "config: 'HopperV9Config\\(\\)' names no kernel config")]
    for i, value, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            op(*args[:i], value, *args[i + 1:])


def test_bad_arguments_fail_while_tracing_too():
    "The fake implementation checks what the real one does: a compiler's trace fails with the same message."
    layer, x = converted()
    args = layer.op_args(x)
    with pytest.raises(Exception, match="smooth: must have the layer's dtype"):
        torch.compile(lambda s: torch.ops.w4a4.linear(*args[:5], s, *args[6:]), fullgraph=True, backend="eager")(
            layer.smooth.float())


def test_layer_bad_input():
    layer, x = converted()
    with pytest.raises(ValueError, match="x is on meta but the layer is on cpu"):
        layer(x.to("meta"))
    with pytest.raises(TypeError, match="x must have dtype in"):
        layer(x.to(torch.float64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer(x.tolist())
    wide = torch.randn(8, 512)[:, ::2]                          # a non-contiguous input is read as it is
    assert not wide.is_contiguous() and torch.equal(layer(wide), layer(wide.contiguous()))


def test_nothing_to_convert_is_named():
    with pytest.raises(ValueError, match="model: no nn.Linear to convert .*it has none"):
        quantize_model(nn.Sequential(nn.ReLU()), quiet=True)
    with pytest.raises(ValueError, match="model: no nn.Linear to convert .*not a multiple"):
        quantize_model(nn.Sequential(nn.Linear(100, 64)), quiet=True)
    with pytest.raises(ValueError, match="model: it holds no W4A4Linear"):
        save_quantized(nn.Sequential(nn.Linear(256, 64)), "unused.pt")


# ---------------------------------------------------------------------------------------------
# On the GPU


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("fmt, act_fmt", [("int4", None), ("int4_pg", None), ("int4_pg", "int8")])
def test_op_on_cuda_against_the_cpu_reference(fmt, act_fmt):
    "On CUDA the op's reference path is the CPU's up to float32 summation order, and its sm90 path is close to it."
    layer, x = converted(fmt, act_fmt, K=1024, N=512, rank=32)
    cpu = torch.ops.w4a4.linear(*layer.op_args(x.bfloat16(), "reference")).float()
    gpu = copy.deepcopy(layer).cuda()
    rel = lambda y: ((y.float().cpu() - cpu).norm() / cpu.norm()).item()
    assert rel(torch.ops.w4a4.linear(*gpu.op_args(x.cuda().bfloat16(), "reference"))) < 1e-3
    assert rel(torch.ops.w4a4.linear(*gpu.op_args(x.cuda().bfloat16(), "sm90"))) < 1e-2
    assert rel(torch.ops.w4a4.linear(*gpu.op_args(x.cuda().bfloat16(), "auto"))) < 1e-2
    torch.library.opcheck(torch.ops.w4a4.linear.default, gpu.op_args(x.cuda().bfloat16(), "sm90"))


@pytest.mark.gpu
@SM90
def test_compile_fullgraph_on_the_gpu():
    model = block(1024, 512, device="cuda")
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
        assert [m.last_backend for m in model if isinstance(m, W4A4Linear)] == ["sm90-v2-rs"] * 2
        assert torch.equal(torch.compile(model, fullgraph=True)(x), eager)


@pytest.mark.gpu
@SM90
def test_forward_reads_nothing_back_from_the_gpu():
    "After the first call (kernel compilation, one check of the weight values) a forward makes no synchronising call."
    model = block(1024, 512, device="cuda")
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        model(x)
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@SM90
def test_cuda_graph_captures_a_converted_block_under_inference_mode():
    "A capture of the block replays to the eager output, bit for bit, on the captured input and on new values in it."
    model = block(1024, 512, device="cuda")
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    x2 = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        eager, eager2 = model(x), model(x2)                     # compiles the kernels, checks the weights once
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                           # warm-up on a side stream, as torch.cuda.graph asks
            model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager2)


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("act_fmt", [None, "int8"])
def test_the_bound_path_computes_what_the_op_does(act_fmt):
    """The eager forward's bound path (`ops.bound_linear`) gives the op's output bit for bit, at M = 1, 17, 256 and
    4352 on one layer (the kernels read M at run time), on a float32 input, at rank 0, and after an in-place write."""
    for rank in (32, 0):
        layer, _ = converted("int4_pg", act_fmt, K=1024, N=512, rank=rank)
        layer = layer.cuda()
        with torch.no_grad():
            for M in (1, 17, 256, 4352, 17):
                x = torch.randn(M, 1024, device="cuda", dtype=torch.bfloat16)
                op = torch.ops.w4a4.linear(*layer.op_args(x, "sm90"))
                assert torch.equal(layer(x), op) and torch.equal(layer(x), op), (rank, M)   # built, then bound
                assert cache.kept(layer.qweight_data)["bound linear"][(M, x.dtype, x.device)].gemm is not None
            x = torch.randn(300, 1024, device="cuda")
            assert torch.equal(layer(x), torch.ops.w4a4.linear(*layer.op_args(x, "sm90"))) and layer(x).dtype == torch.float32
            layer.smooth.mul_(1.5)
            layer.wcscales.mul_(0.5)
            assert torch.equal(layer(x), torch.ops.w4a4.linear(*layer.op_args(x, "sm90")))


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("act_fmt", [None, "int8"])
def test_layers_sharing_a_workspace_compute_what_the_unbound_path_does(act_fmt, monkeypatch):
    """Layers of different shapes, called back to back with no sync on one stream and at the same time on a second,
    share each stream's workspace (grown as the shapes ask): every output is the unbound path's (new buffers for every
    intermediate), bit for bit."""
    shapes = ((1024, 512, 32, 256), (512, 1024, 16, 4352), (1024, 256, 0, 17))     # (K, N, rank, M)
    layers = [converted("int4_pg", act_fmt, K=K, N=N, rank=R)[0].cuda() for K, N, R, _ in shapes]
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for K, _, _, M in shapes]
    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setattr(ops, "bound_linear", lambda args: None)
            want = [layer(x) for layer, x in zip(layers, xs)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        got = []
        for _ in range(3):
            got += [(i, layers[i](xs[i])) for i in range(3)]
            with torch.cuda.stream(side):
                got += [(i, layers[i](xs[i])) for i in (2, 1, 0)]
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    assert all(torch.equal(y, want[i]) for i, y in got), [i for i, y in got if not torch.equal(y, want[i])]


_CACHED_FORWARD = """
import sys, torch
from torch import nn
from w4a4_book import jit
from w4a4_book.layers import W4A4Linear
torch.manual_seed(0)
layer = W4A4Linear.from_linear(nn.Linear(512, 256), rank=32, fmt="int4_pg").cuda()
with torch.no_grad():
    y = layer(torch.randn(17, 512, generator=torch.Generator().manual_seed(1)).cuda().bfloat16())
torch.save(y.cpu(), sys.argv[1])
print(jit.CACHE_STATS)
"""


@pytest.mark.gpu
@SM90
def test_a_new_process_loads_the_compiled_kernels_from_disk(tmp_path):
    "The first process compiles the layer's three kernels and saves them; a second loads all three and computes the same."
    import ast, os, subprocess, sys
    env = {**os.environ, jit.KERNEL_CACHE_ENV: str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", _CACHED_FORWARD, str(tmp_path / f"y{i}.pt")], env=env,
                           capture_output=True, text=True, timeout=400) for i in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    first, second = (ast.literal_eval(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first == {"compiled": 3, "loaded": 0, "stored": 3}        # the two activation passes and the GEMM
    assert second == {"compiled": 0, "loaded": 3, "stored": 0}
    assert torch.equal(torch.load(tmp_path / "y0.pt"), torch.load(tmp_path / "y1.pt"))


# ---------------------------------------------------------------------------------------------
# The host path of an sm90 forward, on the CPU: compilation, launches and device queries stubbed


class Launch(tuple):
    "One stubbed launch: its tensors, in the kernel's argument order; `names`: the arguments' names."
    names: tuple = ()


def is_bundle(arg) -> bool:
    "Whether a launch argument (an `ArgSpec` or a tensor, or a bundle of them) is a bundle: a tuple passed as one."
    from w4a4_book.kernels.sm90_parts import ArgSpec
    return isinstance(arg, tuple) and not isinstance(arg, ArgSpec)


def flat(args) -> list:
    "A launch's `ArgSpec`s or tensors with each bundle's in its place."
    return [x for a in args for x in (flat(a) if is_bundle(a) else [a])]


@pytest.fixture
def stubbed_sm90(monkeypatch):
    """Run the sm90 path's host code on the CPU: the device checks pass, nothing compiles, and each "launch" records
    the torch tensors the compiled function would be called with. Returns the list of `Launch`es."""
    from w4a4_book import operands
    launches = []
    def compile_launchable(kernel, specs, dynamic_m, options=""):
        names = tuple(s.name for s in flat(specs))
        def launch(*tensors):
            assert [isinstance(t, tuple) for t in tensors] == [is_bundle(s) for s in specs], (specs, tensors)
            tensors = flat(tensors)
            assert len(tensors) == len(names), (names, len(tensors))
            rec = Launch(tensors)
            rec.names = names
            launches.append(rec)
        return launch
    monkeypatch.setattr(operands, "check_devices", lambda *a, **k: None)
    monkeypatch.setattr(ops, "why_not_sm90", lambda *a, **k: None)
    for module in (jit, act_quant):                          # each asks the SM count through its own import
        monkeypatch.setattr(module, "sm_count", lambda index: 132)
    monkeypatch.setattr(jit, "_compiled", {})
    monkeypatch.setattr(jit, "compile_launchable", compile_launchable)
    monkeypatch.setenv(jit.KERNEL_CACHE_ENV, "off")
    return launches


def sm90_layer(fmt="int4_pg", M=16, K=512, N=256, rank=32):
    torch.manual_seed(0)
    return W4A4Linear.from_linear(nn.Linear(K, N), rank=rank, fmt=fmt, backend="sm90"), torch.randn(M, K, dtype=torch.bfloat16)


@pytest.mark.parametrize("fmt", ["int4_pg", "int4"])
def test_the_gemm_is_launched_on_the_layers_buffers(stubbed_sm90, fmt):
    """The GEMM's weight-side tensors are the layer's buffers (or tensors packed from them once): the same tensors on a
    second forward, of the new values after an in-place write, and the new buffers after a copy (as `.to()` makes)."""
    layer, x = sm90_layer(fmt)
    layer(x)
    first = stubbed_sm90[-1]                                    # the GEMM is the forward's last launch
    layer(x)
    again = stubbed_sm90[-1]
    assert layer.last_backend.startswith("sm90-") and "out" in again.names
    specs = flat(gemm_class(fmt).arguments(layer.problem(x.shape[0])))
    assert again.names == tuple(a.name for a in specs)
    weight = [i for i, a in enumerate(specs) if x.shape[0] not in a.shape]   # no extent M: never an activation
    assert "wcscales" in again.names and again.names.index("wcscales") in weight
    assert all(again[i].data_ptr() == first[i].data_ptr() for i in weight)   # nothing is remade per call
    i = again.names.index("wcscales")
    assert again[i].data_ptr() == layer.wcscales.data_ptr()
    with torch.no_grad():
        layer.wcscales.mul_(2)                                   # in place: the same buffer, new values
    layer(x)
    assert torch.equal(stubbed_sm90[-1][i], layer.wcscales)
    moved = copy.deepcopy(layer)                                 # new buffers: new tensors
    moved(x)
    assert stubbed_sm90[-1][i].data_ptr() == moved.wcscales.data_ptr() != layer.wcscales.data_ptr()


def quant_launches(launches, layer, x):
    "The activation-kernel launches of one forward of `layer` on `x` (every launch but the GEMM's)."
    n = len(launches)
    layer(x)
    return [a for a in launches[n:] if "recip_smooth" in a.names]


@pytest.mark.parametrize("fmt", ["int4_pg", "int4"])
def test_activation_launches_follow_the_layers_buffers(stubbed_sm90, fmt):
    """The activation kernel's weight-side tensors (1/smooth and lora_downᵀ) are made once per buffer: the same
    tensors on a second forward, new ones (of the new values) after an in-place write, a `.to()` and a copy."""
    from w4a4_book.formats import reciprocal
    layer, x = sm90_layer(fmt, M=8)
    first = quant_launches(stubbed_sm90, layer, x)
    assert len(first) == (2 if fmt == "int4_pg" else 1)
    assert first[0].names == act_quant.QUANT_ARGS and (fmt != "int4_pg" or first[1].names == act_quant.ROW_CODES_ARGS)
    for a, b in zip(first, quant_launches(stubbed_sm90, layer, x)):
        assert a[1] is b[1]                                              # 1/smooth: cached
        if a.names == act_quant.QUANT_ARGS:
            assert a[2] is b[2]                                          # lora_downᵀ: cached
    def follows(lyr):
        for args in quant_launches(stubbed_sm90, lyr, x):
            assert torch.equal(args[1], reciprocal(lyr.smooth.float()))
            if args.names == act_quant.QUANT_ARGS:
                assert torch.equal(args[2], lyr.lora_down.t())
    with torch.no_grad():
        layer.smooth.mul_(2)
        layer.lora_down.neg_()
    follows(layer)
    assert quant_launches(stubbed_sm90, layer, x)[0][1] is not first[0][1]
    follows(layer._apply(torch.clone))          # `.to(device)`'s way: every buffer a new one, in place of the old
    follows(copy.deepcopy(layer))


def test_derived_tensors_are_cached_per_buffer_version():
    "`cache.derived` remakes its tensor after an in-place write and for a new buffer, and never keeps one of an inference tensor."
    t, calls = torch.ones(4), []
    make = lambda s: calls.append(1) or s * 2
    a = cache.derived(t, "twice", make)
    assert cache.derived(t, "twice", make) is a and len(calls) == 1
    assert cache.derived(t, "other", make) is not a                # each `what` its own
    t.add_(1)
    assert torch.equal(cache.derived(t, "twice", make), torch.full((4,), 4.0))
    assert torch.equal(cache.derived(t.clone(), "twice", make), torch.full((4,), 4.0)) and len(calls) == 4
    with torch.inference_mode():
        inf = torch.ones(4)
        assert not cache.derived(t, "twice", make).is_inference()  # made outside inference mode: it has a counter
        assert cache.derived(inf, "twice", make) is not cache.derived(inf, "twice", make)
    assert cache.constant(1.0, (3,), torch.float32, t.device) is cache.constant(1.0, (3,), torch.float32, t.device)


def gemm_class(fmt):
    return registry.find_kernel(None, fmt).kernel_class()


@pytest.mark.parametrize("fmt", ["int4_pg", "int4"])
def test_host_time_per_stubbed_forward_is_reported(stubbed_sm90, fmt, capsys):
    "The host's time per eager forward with the kernels stubbed, printed (the target is checked on the GPU, not here)."
    from w4a4_book.bench.layer import host_time
    layer, x = sm90_layer(fmt)
    with torch.inference_mode():
        t = host_time(lambda: layer(x), warmup=10, iters=200)
    assert t["n"] == 200 and 0 < t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
    with capsys.disabled():
        print(f"\n{fmt} stubbed sm90 forward, M={x.shape[0]}: host {t['median_ms'] * 1e3:.1f} us per call "
              f"(p10 {t['p10_ms'] * 1e3:.1f}, p90 {t['p90_ms'] * 1e3:.1f})")


def test_the_op_chooses_its_tile_for_the_batch():
    "`w4a4::linear` builds its problem with the batch's M, so the default kernel's tile follows M (`heuristics.tile_choice`)."
    from w4a4_book.operands import Problem
    def tile(M):
        p = Problem(M, 3072, 3840, 32, scale_dtype=torch.uint8, fmt="int4_pg")
        return ops._kernel("sm90", torch.zeros(M, 3840), p, "").tile_m
    assert (tile(256), tile(1024), tile(4352), tile(8192)) == (64, 208, 208, 256)   # small M fills the SMs; the rest fit the waves


def test_a_second_import_registers_the_op_again():
    "Importing `w4a4_book.ops` again (a doc renderer does) replaces the op's registration instead of raising."
    import importlib
    layer, x = W4A4Linear.from_linear(nn.Linear(64, 32), rank=16), torch.randn(4, 64)
    want = layer(x)
    importlib.reload(ops)
    assert torch.equal(torch.ops.w4a4.linear(*layer.op_args(x)), want)


def bound_plans(layer):
    return cache.kept(layer.qweight_data).get("bound linear", {})


def test_the_bound_path_is_kept_per_m_and_rebuilt_when_a_buffer_changes(stubbed_sm90):
    """An eager int4_pg forward binds once per M and launches the two activation passes and the GEMM; an in-place write,
    a new buffer or a new M builds another, and the old buffers' plans are dropped."""
    from w4a4_book.formats import reciprocal
    layer, x = sm90_layer("int4_pg", M=16)
    with torch.no_grad():
        y = layer(x)
        assert y.shape == (16, 256) and y.dtype == torch.bfloat16 and layer.last_backend.startswith("sm90-")
        (key, plan), = bound_plans(layer).items()
        n = len(stubbed_sm90)
        layer(x)
        assert [l.names[0] for l in stubbed_sm90[n:]] == ["x", "x", "act"]        # three launches, nothing else
        assert bound_plans(layer)[key] is plan and stubbed_sm90[-3][0].data_ptr() == x.data_ptr()   # x itself, no copy
        layer(torch.randn(5, 512, dtype=torch.bfloat16))
        assert len(bound_plans(layer)) == 2 and stubbed_sm90[-1][0].shape == (5, 512)
        layer.smooth.mul_(2)                                                      # in place: every plan goes
        layer(x)
        assert list(bound_plans(layer)) == [key] and bound_plans(layer)[key] is not plan
        assert torch.equal(stubbed_sm90[-3][1], reciprocal(layer.smooth.float()))
        y32 = layer(x.float())                                                   # a float32 input: cast in, cast out
        assert y32.dtype == torch.float32 and stubbed_sm90[-3][0].dtype == torch.bfloat16
        moved = copy.deepcopy(layer)
        moved(x)
        assert bound_plans(moved) and all(p.stamp != bound_plans(moved)[key].stamp for p in bound_plans(layer).values())


def test_a_kernel_compiled_per_m_runs_the_op(stubbed_sm90):
    "The int4 kernels are compiled per M: an int4 layer keeps the checked op path (no plan is kept) and launches."
    layer, x = sm90_layer("int4")
    with torch.no_grad():
        layer(x)
        n = len(stubbed_sm90)
        layer(x)
    assert not bound_plans(layer)
    assert [l.names[0] for l in stubbed_sm90[n:]] == ["x", "act"]


def test_a_layer_made_under_inference_mode_runs(stubbed_sm90):
    "Inference tensors have no version counter: the forward neither caches nor binds on them, and runs."
    with torch.inference_mode():
        layer, x = sm90_layer("int4_pg")
        layer(x)
        layer(x)
    assert not bound_plans(layer) and stubbed_sm90[-1].names[0] == "act"


def test_the_op_itself_binds(stubbed_sm90):
    "`torch.ops.w4a4.linear` (what a compiled graph calls) takes the bound path too, on the plan the eager forward keeps."
    layer, x = sm90_layer("int4_pg")
    args = layer.op_args(x, "sm90")
    with torch.no_grad():
        torch.ops.w4a4.linear(*args)
        (plan,) = bound_plans(layer).values()
        n = len(stubbed_sm90)
        torch.ops.w4a4.linear(*args)
        layer(x)
    assert [l.names[0] for l in stubbed_sm90[n:]] == ["x", "x", "act"] * 2 and list(bound_plans(layer).values()) == [plan]


def test_the_activation_side_lives_in_a_workspace_per_thread_and_stream(stubbed_sm90):
    """A bound forward writes the activation side (row maxima, LoRA partials, codes, bases, lora_act) into one buffer
    kept per thread and stream, the same on every call and shared by layers; the public `bind_quantize_rows` returns
    new codes each call; another thread gets its own buffer."""
    import threading
    layer, x = sm90_layer("int4_pg", M=16)
    other, _ = sm90_layer("int4_pg", M=16, N=128)
    def ptrs():                               # the activation passes' tensors of the last forward
        return [t.data_ptr() for l in stubbed_sm90[-3:-1] for t in l[3:]]
    with torch.no_grad():
        layer(x)
        n = len(stubbed_sm90)
        layer(x)
        first = ptrs()
        layer(x)
        assert ptrs() == first and len(stubbed_sm90) == n + 6          # the same buffers, no new launch
        other(x)
        assert ptrs() == first                                         # another layer of the same shapes shares them
        gemm_codes = stubbed_sm90[-1][0]
        assert gemm_codes.data_ptr() == stubbed_sm90[-3][3].data_ptr()  # the GEMM reads the codes the passes wrote
        rows = act_quant.bind_quantize_rows(x, layer.smooth, None, fmt="int4_pg")
        a, b = rows(x), rows(x)
        assert a[0].data_ptr() != b[0].data_ptr() and a[0].shape == (16, 512) and a[0].dtype == torch.int8
        seen = []
        t = threading.Thread(target=lambda: seen.append(cache.stream_workspace(x.device, 64)[1].data_ptr()))
        t.start(); t.join()
        assert seen[0] != cache.stream_workspace(x.device, 64)[1].data_ptr()


def test_under_a_capture_nothing_made_is_kept(stubbed_sm90, monkeypatch):
    """Under a CUDA-graph capture (`cache.capturing`, pretended on the CPU) a bound forward writes its activation side
    into a new buffer and keeps no view of it, a new M builds no plan (the checked path runs), and a weight's check is
    not recorded."""
    layer, x = sm90_layer("int4_pg", M=16)
    fresh, _ = sm90_layer("int4_pg", M=16)
    with torch.no_grad():
        layer(x)                                                    # the plan, built before the capture
        (plan,) = bound_plans(layer).values()
        views, codes = dict(plan.quantize.views), stubbed_sm90[-1][0]
        monkeypatch.setattr(cache, "capturing", lambda dev: True)
        layer(x)
        assert stubbed_sm90[-1][0].data_ptr() != codes.data_ptr()   # the GEMM reads codes from a new buffer
        assert list(plan.quantize.views) == list(views) and all(plan.quantize.views[k] is views[k] for k in views)
        layer(torch.randn(5, 512, dtype=torch.bfloat16))
        assert list(bound_plans(layer).values()) == [plan] and stubbed_sm90[-1][0].shape[0] == 5
        ops.weights(fresh.qweight_data, fresh.qweight_scales, fresh.fmt, None, fresh.qweight_base)
        assert "checked at" not in cache.kept(fresh.qweight_data)


def test_a_workspace_grows_and_its_old_views_are_not_reused(stubbed_sm90):
    """A larger request replaces the thread's buffer; a plan's views of the old buffer are made again on the new one,
    and the plan keeps one set of views per stream, not one per buffer it has seen."""
    layer, x = sm90_layer("int4_pg", M=16)
    with torch.no_grad():
        layer(x)
        before = stubbed_sm90[-1][0].data_ptr()
        _, big = cache.stream_workspace(x.device, 1 << 22)
        layer(x)
    (plan,) = bound_plans(layer).values()
    assert stubbed_sm90[-1][0].data_ptr() == big.data_ptr() + plan.quantize.offsets[-2]        # codes: the last buffer
    assert before != stubbed_sm90[-1][0].data_ptr()
    assert len(plan.quantize.views) == 1 and plan.quantize.views[next(iter(plan.quantize.views))][0] is big


def test_a_thread_keeps_a_bounded_number_of_stream_workspaces():
    "Past `MAX_STREAM_WORKSPACES` streams a thread's oldest stream's buffer is dropped."
    import threading
    spaces = {}
    def fill():
        cache._WORKSPACES.spaces = {((torch.device("cpu"), s, threading.get_ident())): torch.empty(1, dtype=torch.uint8)
                                   for s in range(1, cache.MAX_STREAM_WORKSPACES + 1)}
        cache.stream_workspace(torch.device("cpu"), 8)              # the CPU's stream 0: a new one
        spaces.update(cache._WORKSPACES.spaces)
    t = threading.Thread(target=fill)
    t.start(); t.join()
    assert len(spaces) == cache.MAX_STREAM_WORKSPACES and [k[1] for k in spaces][-1] == 0 and 1 not in [k[1] for k in spaces]
