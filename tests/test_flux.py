"""FLUX.1 from diffusers (`nbs/19_flux.ipynb`): the reduced model converted with calibration by keyword arguments, its
error per format and preset, a bf16 cast, one compiled graph, a bit-exact save and load; skipped without diffusers."""
import copy

import pytest
import torch

pytest.importorskip("diffusers")

from w4a4_book.flux import (FLUX_DEV, FLUX_FORMATS, conversion_error, converted_bytes, flux_filter, flux_inputs,
                            flux_model, weight_bytes)
from w4a4_book.layers import load_quantized, quantize_model, save_quantized


@pytest.fixture(scope="module")
def small():
    return flux_model(), flux_inputs(), [flux_inputs(seed=1)]


def test_preset_converts_the_blocks_and_counts_its_bytes(small):
    model, inputs, calibration = small
    q = quantize_model(copy.deepcopy(model), calibration=calibration, filter=flux_filter(), quiet=True)
    kept = [n for n, _ in q.w4a4_conversion.skipped]
    assert "proj_out" in kept and "x_embedder" in kept and "norm_out.linear" in kept
    assert q.w4a4_conversion.smoothed and weight_bytes(q) == converted_bytes(model, filter=flux_filter())


@pytest.mark.parametrize("form", list(FLUX_FORMATS))
def test_error_per_format_is_small_with_the_preset(small, form):
    "Tolerance: the preset's error on this random model was under 0.02 in every format; 0.05 leaves room."
    model, inputs, calibration = small
    assert conversion_error(model, inputs, calibration, flux_filter(), form=form) < 0.05


def test_bf16_cast_compile_and_save_load_are_exact(small, tmp_path):
    model, inputs, calibration = small
    q = quantize_model(copy.deepcopy(model), calibration=calibration, filter=flux_filter(), quiet=True)
    bf = q.to(dtype=torch.bfloat16)
    kw = {k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() and not k.endswith("_ids") else v
          for k, v in inputs.items()}
    with torch.no_grad():
        y = bf(**kw)[0]
        assert y.dtype == torch.bfloat16 and bf.transformer_blocks[0].attn.to_q.qweight_data.dtype == torch.uint8
        assert torch.equal(torch.compile(bf, fullgraph=True, backend="aot_eager")(**kw)[0], y)
        save_quantized(bf, tmp_path / "flux.safetensors")
        loaded = load_quantized(flux_model(seed=3).bfloat16(), tmp_path / "flux.safetensors")
        assert torch.equal(loaded(**kw)[0], y)


def test_flux_dev_preset_weighs_under_half_of_bf16():
    dev = flux_model(FLUX_DEV, device="meta", dtype=torch.bfloat16)
    assert dev.x_embedder.weight.is_meta and sum(isinstance(m, torch.nn.Linear) for m in dev.modules()) == 504
    assert converted_bytes(dev, filter=flux_filter()) <= weight_bytes(dev) / 2
    assert converted_bytes(dev, filter=flux_filter("all")) < converted_bytes(dev, filter=flux_filter())


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="preset: 'x' must be one of"):
        flux_filter("x")
    with pytest.raises(ValueError, match="form: 'fp8' must be one of"):
        conversion_error(torch.nn.Linear(4, 4), {}, form="fp8")
