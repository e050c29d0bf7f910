"""The FLUX-like block of `nbs/17_block.ipynb` at tiny widths: its shape, its seeding, and its error per format after
`quantize_model`, on the CPU."""
import math

import pytest
import torch
import torch.nn as nn

from w4a4_book.block import FluxLikeBlock, block_error, block_inputs, flux_like_block

LINEARS = ["mod", "qkv", "proj", "fc1", "fc2"]


@pytest.fixture(scope="module")
def tiny():
    return flux_like_block(256, 512, 4, seed=3)


def test_shape_and_linears(tiny):
    x, c = block_inputs(tiny, 32, batch=2, seed=1)
    with torch.no_grad():
        assert tiny(x, c).shape == (2, 32, 256)
    assert [n for n, m in tiny.named_modules() if isinstance(m, nn.Linear)] == LINEARS
    with pytest.raises(ValueError, match="multiple of heads"):
        FluxLikeBlock(256, 512, 3)


def test_seeded(tiny):
    other = flux_like_block(256, 512, 4, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(tiny.state_dict().values(), other.state_dict().values()))
    assert not torch.equal(flux_like_block(256, 512, 4, seed=4).fc1.weight, tiny.fc1.weight)
    assert torch.equal(block_inputs(tiny, 32, seed=5)[0], block_inputs(tiny, 32, seed=5)[0])


def test_error_per_format(tiny):
    inputs, calib = block_inputs(tiny, 32, seed=1), [block_inputs(tiny, 32, seed=2)]
    rows = block_error(tiny, inputs, calibration=calib)
    assert [r["format"] for r in rows] == ["bf16", "int4", "int4_pg", "nvfp4", "w4a8"]
    assert all(r["converted"] == LINEARS for r in rows[1:]) and rows[0]["converted"] == []
    for r in rows:
        assert math.isfinite(r["out_err"]) and 0 < r["update_err"] < 1, r
    err = {r["format"]: r["update_err"] for r in rows}
    assert err["bf16"] < 0.1 * min(v for k, v in err.items() if k != "bf16"), err
    assert block_error(tiny, inputs, calibration=calib) == rows                   # deterministic
    kept = block_error(tiny, inputs, fmts=("int4_pg",), calibration=calib, filter=lambda n, m: n != "mod",
                       w4a8=False, bf16=False)
    assert kept[0]["converted"] == LINEARS[1:]
    assert tiny.fc1.__class__ is nn.Linear                                       # the block itself is left as it was
