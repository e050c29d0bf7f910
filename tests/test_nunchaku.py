"""nunchaku's int4 FLUX checkpoints: the packer against nunchaku's own output, the unpacked layer bit for bit, the
mapping onto `W4A4Linear` against a float64 model of nunchaku's operator order, the loader, its errors, the command."""
import json
import re
import subprocess
import sys

import pytest
import torch

from w4a4_book.nunchaku import (GELU_SHIFT, NUNCHAKU_DIGESTS, NunchakuLayer, concat_k, exact_error, fold_shift,
                                nunchaku_epilogue_ref, nunchaku_ref, pack_awq, pack_layer, pack_lowrank, pack_vector,
                                pack_weight, packed_digests, random_layer, read_checkpoint, split_rows, to_w4a4,
                                unpack_awq, unpack_layer, unpack_lowrank, unpack_vector, unpack_weight)

TENSORS = ("codes", "wscales", "bias", "smooth", "lora_down", "lora_up")


def same(a, b) -> bool:
    "Bit for bit: dtype, shape and values."
    return a.dtype == b.dtype and torch.equal(a, b)


def test_packer_writes_what_nunchakus_packer_writes():
    assert packed_digests() == NUNCHAKU_DIGESTS


@pytest.mark.parametrize("N, K, R", [(128, 128, 16), (256, 384, 32), (384, 640, 64)])
def test_pack_unpack_both_ways(N, K, R):
    g = torch.Generator().manual_seed(N + K)
    codes = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
    assert same(unpack_weight(pack_weight(codes)), codes)
    q = pack_weight(codes)
    assert same(pack_weight(unpack_weight(q)), q)
    for v in (torch.randn(K // 64, N, generator=g).bfloat16(), torch.randn(N, generator=g).half()):
        assert same(unpack_vector(pack_vector(v)), v) and same(pack_vector(unpack_vector(v)), v)
    down, up = torch.randn(R, K, generator=g).bfloat16(), torch.randn(N, R, generator=g).bfloat16()
    assert same(unpack_lowrank(pack_lowrank(down, True), True), down)
    assert same(unpack_lowrank(pack_lowrank(up, False), False), up)
    awq = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    assert same(unpack_awq(pack_awq(awq)), awq)


@pytest.mark.parametrize("call, kind, match", [
    (lambda: pack_weight(torch.zeros(128, 96, dtype=torch.int8)), ValueError, "codes: has shape (128, 96)"),
    (lambda: pack_weight(torch.zeros(128, 128)), TypeError, "codes: must be a 2-D tensor of int8"),
    (lambda: unpack_weight(torch.zeros(64, 64, dtype=torch.int8)), ValueError, "qweight: has shape (64, 64)"),
    (lambda: pack_vector(torch.ones(3, 100)), ValueError, "v: has shape (3, 100)"),
    (lambda: pack_lowrank(torch.ones(24, 128, dtype=torch.bfloat16), True), ValueError, "w: has shape (24, 128)"),
    (lambda: pack_awq(torch.zeros(6, 64, dtype=torch.uint8)), ValueError, "q: has shape (6, 64)"),
    (lambda: unpack_awq(torch.zeros(2, 20, dtype=torch.int32)), ValueError, "qweight: has shape (2, 20)"),
])
def test_packer_arguments_are_named(call, kind, match):
    with pytest.raises(kind, match=re.escape(match)):
        call()


def _stored(layer: NunchakuLayer, prefix: str = "b.0.fc") -> dict:
    return {f"{prefix}.{k}": v for k, v in pack_layer(layer).items()}


@pytest.mark.parametrize("rank", [0, 16, 32])
def test_unpacked_layer_is_bit_exact(rank):
    layer = random_layer(256, 256, rank, torch.float16, generator=torch.Generator().manual_seed(rank))
    layer = layer._replace(wcscales=torch.rand(256).half() + 0.5, wtscale=0.5)
    back = unpack_layer(_stored(layer), "b.0.fc")
    assert all(same(getattr(back, f), getattr(layer, f)) for f in TENSORS)
    assert same(back.wcscales, layer.wcscales) and back.wtscale == 0.5
    assert all(same(v, pack_layer(back)[k]) for k, v in pack_layer(layer).items())


def test_int4_layer_matches_nunchakus_order():
    """Fed the same quantized activations, the int4 layer is nunchaku's operator: float32 products of 16-bit operands
    are exact, and each float32 addition rounds by 2^-24 of the running sum, so over K = 512 the error is far below
    1e-5 of the output's largest value."""
    layer = random_layer(384, 512, 32, generator=torch.Generator().manual_seed(1))
    lin = to_w4a4(layer, "int4", backend="reference")
    x = torch.randn(32, 512).bfloat16().float()
    act, lora_act = lin.quantize_input(x)
    ref = nunchaku_epilogue_ref(layer, act, lora_act)
    assert (lin(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_shift_folds_into_bias_to_one_16bit_rounding():
    """A GELU input's shift becomes part of the bias: the only error left is the bias's rounding to bfloat16, half
    an ulp, at most 2^-8 of its magnitude (bfloat16 keeps 8 significant bits)."""
    layer = random_layer(256, 512, 32, shift=GELU_SHIFT, generator=torch.Generator().manual_seed(2))
    lin = to_w4a4(layer, "int4", backend="reference")
    x = torch.nn.functional.gelu(torch.randn(16, 512)).bfloat16().float()
    act, lora_act = lin.quantize_input(x)
    err = (lin(x).double() - nunchaku_epilogue_ref(layer, act, lora_act)).abs()
    bias = fold_shift(layer).bias.abs()
    assert (err <= 2.0 ** -8 * bias + 1e-5).all()


def test_split_and_concat_are_exact():
    """A fused layer cut along N, and two layers joined along K, compute what nunchaku's layers compute, to float32
    rounding; the joined bias is one 16-bit rounding of the sum, exact where one of the two is zero (as here)."""
    g = torch.Generator().manual_seed(3)
    qkv = random_layer(384, 256, 32, generator=g)
    parts = split_rows(qkv, 3)
    assert exact_error([qkv], [to_w4a4(p, backend="reference") for p in parts], rows=16) < 1e-6
    a, b = random_layer(128, 128, 32, generator=g), random_layer(128, 512, 32, generator=g)
    b = b._replace(bias=torch.zeros(128, dtype=torch.bfloat16))
    joined = to_w4a4(concat_k([a, b]), backend="reference")
    assert (joined.in_features, joined.rank) == (640, 64)
    assert exact_error([a, b], [joined], rows=16) < 1e-6


def test_int4_pg_folds_wcscales_and_int4_refuses_them():
    layer = random_layer(128, 256, 16, generator=torch.Generator().manual_seed(4))
    scaled = layer._replace(wcscales=torch.full((128,), 2.0).bfloat16())
    with pytest.raises(ValueError, match="fmt: 'int4' keeps the stored scales.*use fmt='int4_pg'"):
        to_w4a4(scaled, "int4")
    x = torch.randn(8, 256).bfloat16().float()
    pg = to_w4a4(scaled, "int4_pg", backend="reference")
    assert torch.equal(pg.wcscales, torch.ones(128).bfloat16())
    y, ref = pg(x).double(), nunchaku_ref(scaled, x, quantize_act=False)
    assert (y - ref).norm() / ref.norm() < 0.25        # int4 activations and an int4_pg weight: both coarse


def test_int4_pg_is_the_int4_layer_requantized():
    "Loading as int4_pg gives what `W4A4Linear.to_int4_pg` makes of the int4 layer: the stored values re-quantized."
    layer = random_layer(256, 256, 32, generator=torch.Generator().manual_seed(7))
    direct, via = to_w4a4(layer, "int4_pg", "int8").state_dict(), to_w4a4(layer).to_int4_pg("int8").state_dict()
    assert direct.keys() == via.keys() and all(same(v, via[k]) for k, v in direct.items())


def test_reference_model_orders_lora_after_the_affine():
    layer = random_layer(128, 128, 16, generator=torch.Generator().manual_seed(5))
    x = torch.randn(4, 128)
    doubled = layer._replace(wcscales=torch.full((128,), 2.0).bfloat16())
    lora = (x.double() @ layer.lora_down.double()).bfloat16().double() @ layer.lora_up.double().T
    diff = nunchaku_ref(doubled, x) - nunchaku_ref(layer, x)
    main = nunchaku_ref(layer, x) - layer.bias.double() - lora
    assert torch.allclose(diff, main, atol=1e-9)         # wcscales scaled the product, not the low-rank term


def _checkpoint(layer: NunchakuLayer) -> dict:
    "A state dict with FLUX's first layers, so the architecture check passes, and `layer` as transformer_blocks.0.x."
    sd = _stored(layer, "transformer_blocks.0.qkv_proj") | _stored(layer, "single_transformer_blocks.0.qkv_proj")
    return sd | _stored(layer, "transformer_blocks.0.x")


@pytest.mark.parametrize("edit, kind, match", [
    (lambda sd: sd.pop("transformer_blocks.0.x.wscales"), ValueError, "checkpoint: lacks transformer_blocks.0.x.wscales"),
    (lambda sd: sd.update({"transformer_blocks.0.x.lora_down": torch.zeros(256, 24).bfloat16()}), ValueError,
     "a rank R that tiles by 16"),
    (lambda sd: sd.update({"transformer_blocks.0.x.qweight": torch.zeros(200, 128, dtype=torch.int8)}), ValueError,
     "must be multiples of 128 and 128"),
    (lambda sd: sd.update({"transformer_blocks.0.x.wscales": torch.zeros(4, 128, dtype=torch.float8_e4m3fn)}),
     TypeError, "nvfp4 checkpoint"),
])
def test_bad_layers_are_named(edit, kind, match):
    sd = _checkpoint(random_layer(128, 256, 32))
    edit(sd)
    with pytest.raises(kind, match=match):
        unpack_layer(sd, "transformer_blocks.0.x")


def test_foreign_and_other_architectures_are_named(tmp_path):
    flux = _checkpoint(random_layer(128, 256, 32))
    read_checkpoint(flux)
    with pytest.raises(ValueError, match="not a nunchaku checkpoint"):
        read_checkpoint({"x_embedder.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="another architecture"):
        read_checkpoint({k.replace("qkv_proj", "attn.to_qkv"): v for k, v in flux.items()})
    (tmp_path / "a.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="is not a safetensors file"):
        read_checkpoint(tmp_path / "a.safetensors")
    with pytest.raises(FileNotFoundError, match="path: no file"):
        read_checkpoint(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file
    save_file(flux, tmp_path / "qwen.safetensors", metadata={"model_class": "NunchakuQwenImageTransformer2DModel"})
    with pytest.raises(ValueError, match="NunchakuQwenImageTransformer2DModel, another architecture"):
        read_checkpoint(tmp_path / "qwen.safetensors")
    save_file(flux, tmp_path / "fp4.safetensors",
              metadata={"quantization_config": json.dumps({"weight": {"dtype": "fp4_e2m1_all"}})})
    with pytest.raises(ValueError, match="holds fp4_e2m1_all weights"):
        read_checkpoint(tmp_path / "fp4.safetensors")


def test_the_base_package_imports_the_reader_without_diffusers():
    code = "import sys, w4a4_book.nunchaku; print('diffusers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"


SMALL = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=64,
             num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
             axes_dims_rope=(16, 24, 24))


@pytest.fixture(scope="module")
def flux():
    "diffusers' FluxTransformer2DModel class and a synthetic nunchaku checkpoint of a small one."
    diffusers = pytest.importorskip("diffusers")
    from w4a4_book.nunchaku import synthetic_checkpoint
    torch.manual_seed(0)
    sd, meta, packed = synthetic_checkpoint(diffusers.FluxTransformer2DModel(**SMALL), seed=1)
    return diffusers.FluxTransformer2DModel, sd, meta, packed


def test_load_nunchaku_puts_each_layer_where_diffusers_has_it(flux):
    from w4a4_book import W4A4Linear, load_nunchaku
    cls, sd, _, packed = flux
    model = load_nunchaku(sd, cls(**SMALL).to(torch.bfloat16), "int4")
    report = model.nunchaku_report
    assert len(report.converted) == 1 * 12 + 2 * 5 and all(isinstance(model.get_submodule(n), W4A4Linear)
                                                           for n in report.converted)
    assert "transformer_blocks.0.norm1.linear" in report.kept and "x_embedder" in report.kept
    qkv = packed["single_transformer_blocks.1.qkv_proj"]
    assert same(model.single_transformer_blocks[1].attn.to_v.qweight_scales, qkv.wscales[:, 256:].contiguous())
    fc2 = fold_shift(packed["transformer_blocks.0.mlp_context_fc2"])
    assert same(model.transformer_blocks[0].ff_context.net[2].bias, fc2.bias.bfloat16())
    assert same(model.transformer_blocks[0].attn.norm_added_k.weight, sd["transformer_blocks.0.norm_added_k.weight"])


def test_adaln_layers_decode_to_diffusers_order(flux):
    "W4A16 codes x scale + zero, the interleaved chunks put back, the folded 1 of each scale chunk taken out."
    from w4a4_book.nunchaku import awq_linear, unpack_awq
    _, sd, _, _ = flux
    p = "single_transformer_blocks.0.norm.linear"
    q, s, z = unpack_awq(sd[f"{p}.qweight"]).float(), sd[f"{p}.wscales"][:2].float(), sd[f"{p}.wzeros"][:2].float()
    w, b = awq_linear(sd, p, 3)
    stored = q * s.T.repeat_interleave(64, 1) + z.T.repeat_interleave(64, 1)       # rows: (channel, chunk)
    assert same(w[128 + 5], stored[5 * 3 + 1].bfloat16())                            # chunk 1 (scale), channel 5
    assert same(b[128 + 5], (sd[f"{p}.bias"][5 * 3 + 1].float() - 1).bfloat16())


def test_load_nunchaku_is_all_or_nothing(flux):
    from w4a4_book import load_nunchaku
    cls, sd, _, _ = flux
    model = cls(**SMALL)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="checkpoint: lacks 'x_embedder.bias'"):
        load_nunchaku({k: v for k, v in sd.items() if k != "x_embedder.bias"}, model)
    with pytest.raises(ValueError, match="model: has 1 single_transformer_blocks, the checkpoint 2"):
        load_nunchaku(sd, cls(**{**SMALL, "num_single_layers": 1}))
    with pytest.raises(TypeError, match="model: must be diffusers' FluxTransformer2DModel"):
        load_nunchaku(sd, torch.nn.Linear(2, 2))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("fmt, act", [("int4", None), ("int4_pg", None), ("int4_pg", "int8")])
def test_loaded_model_runs_and_measures_its_error(flux, fmt, act):
    from w4a4_book import load_nunchaku
    cls, sd, _, _ = flux
    with torch.device("meta"):
        model = cls(**SMALL)
    load_nunchaku(sd, model, fmt, act, check_rows=8)
    assert not any(t.is_meta for t in model.state_dict().values())
    errors = model.nunchaku_report.errors
    assert len(errors) == 8 + 2 * 3 and all(0 < e < 0.3 for e in errors.values())
    bf = dict(dtype=torch.bfloat16)
    with torch.no_grad():
        out = model(hidden_states=torch.randn(1, 16, 16, **bf), encoder_hidden_states=torch.randn(1, 8, 64, **bf),
                    pooled_projections=torch.randn(1, 32, **bf), timestep=torch.tensor([0.5]),
                    guidance=torch.tensor([3.5]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3)).sample
    assert out.shape == (1, 16, 16) and torch.isfinite(out).all()


def test_convert_nunchaku_writes_what_load_quantized_reads(flux, tmp_path, capsys):
    from safetensors.torch import save_file
    from w4a4_book import load_quantized
    from w4a4_book.cli import main
    from w4a4_book.nunchaku import flux_from_nunchaku
    cls, sd, meta, _ = flux
    save_file(sd, tmp_path / "in.safetensors", metadata=meta)
    assert main(["convert-nunchaku", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"),
                 "--fmt", "int4_pg", "--act", "int8", "--rows", "4"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and "converted 22 linears, kept" in out and "int8 activations" in out
    assert "converting" in err and "14/14" in err               # the progress bar, over the nunchaku layers
    loaded = load_quantized(cls(**SMALL).to(torch.bfloat16), tmp_path / "out.safetensors")
    direct = flux_from_nunchaku(tmp_path / "in.safetensors", "int4_pg", "int8").state_dict()
    assert loaded.state_dict().keys() == direct.keys()
    assert all(torch.equal(v, direct[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("argv, match", [
    (["--fmt", "int4", "--act", "int8"], "--act: int8 activations pair with --fmt int4_pg"),
    (["--fmt", "int4", "--rows", "-1"], "--rows: must be >= 0"),
])
def test_convert_nunchaku_errors_are_one_line(tmp_path, capsys, argv, match):
    from w4a4_book.cli import main
    assert main(["convert-nunchaku", str(tmp_path / "in.safetensors"), str(tmp_path / "o.safetensors"), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err


def test_convert_nunchaku_without_diffusers_names_the_extra(tmp_path, capsys, monkeypatch):
    from w4a4_book.cli import main
    monkeypatch.setitem(sys.modules, "diffusers", None)                 # `import diffusers` raises ImportError
    assert main(["convert-nunchaku", str(tmp_path / "in.safetensors"), str(tmp_path / "o.safetensors"),
                 "--fmt", "int4"]) == 1
    assert capsys.readouterr().err.strip() == ("w4a4-book convert-nunchaku: a FLUX transformer needs diffusers: "
                                               "pip install 'w4a4_book[flux]'")


def test_convert_nunchaku_names_a_missing_input(tmp_path, capsys):
    from w4a4_book.cli import main
    assert main(["convert-nunchaku", str(tmp_path / "no.safetensors"), str(tmp_path / "o.safetensors"),
                 "--fmt", "int4"]) == 2
    assert "path: no file at" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("fmt, act", [("int4", None), ("int4_pg", None), ("int4_pg", "int8")])
def test_flux_width_layers_run_on_the_sm90_kernels(fmt, act):
    "A FLUX.1 qkv layer (3072 -> 9216, rank 32) and an mlp_fc2 (12288 -> 3072) run on the sm90 kernels."
    g = torch.Generator().manual_seed(6)
    for N, K, shift in ((9216, 3072, 0.0), (3072, 12288, GELU_SHIFT)):
        lin = to_w4a4(random_layer(N, K, 32, shift=shift, generator=g), fmt, act).cuda()
        x = torch.randn(256, K, generator=g).cuda().bfloat16()
        y = lin(x)
        assert lin.last_backend.startswith("sm90-")
        lin.backend = "reference"
        ref = lin(x)
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
