"""`w4a4-book bench-block` (`nbs/20d_bench_block.ipynb`): the FP8 module, the table, the command without a GPU, and
on a GPU a small block timed in every path and mode."""
import argparse
import contextlib
import io

import pytest
import torch
import torch.nn as nn

from w4a4_book.bench import block as bench_block
from w4a4_book.block import flux_like_block
from w4a4_book.bench.timing import rel_err
from w4a4_book.bench.workloads import kernel_unavailable


def test_to_fp8_replaces_every_linear_with_fp8_buffers():
    blk = bench_block.to_fp8(flux_like_block(256, 512, 4).bfloat16())
    fp8 = {n: m for n, m in blk.named_modules() if isinstance(m, bench_block.Fp8RowwiseLinear)}
    assert list(fp8) == ["mod", "qkv", "proj", "fc1", "fc2"] and not any(type(m) is nn.Linear for m in blk.modules())
    assert all(m.qweight.dtype == torch.float8_e4m3fn and m.weight_scale.shape == (1, m.out_features)
               and m.bias.dtype == torch.bfloat16 for m in fp8.values())
    with pytest.raises(TypeError, match="linear must be a torch.nn.Linear"):
        bench_block.Fp8RowwiseLinear(nn.LayerNorm(16))


def test_block_table_on_made_up_rows():
    "Made-up rows, not measurements: the speed-ups are the base's time over the path's, the fastest per mode last."
    rows = [dict(method=p, mode=m, tokens=256, hidden=512, mlp=1024, heads=4, median_ms=t)
            for p, t in (("bf16", 4.0), ("fp8", 3.0), ("int4_pg", 2.0), ("w4a8", 2.5)) for m in ("eager", "graph")]
    lines = bench_block.block_table(rows).splitlines()
    assert lines[4] == "| int4_pg | 2.000 | 2.000 | 2.00× | 1.50× | 2.00× | 1.50× |"
    assert lines[-1] == "| fastest | int4_pg | int4_pg |  |  |  |  |"


def test_command_without_a_gpu_prints_the_records_or_none():
    p = argparse.ArgumentParser()
    bench_block.add_arguments(p)
    with pytest.raises(ValueError, match="multiple of heads"):
        bench_block.run(p.parse_args(["--hidden", "3100"]))
    if kernel_unavailable() is None:
        pytest.skip("a GPU the kernels run on: the command would measure")
    args = p.parse_args(["--tokens", "256"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench_block.run(args) == 0
    assert out.getvalue().strip().endswith("No recorded block runs at 256 tokens, hidden 3072, MLP 12288, 24 heads.")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_linear_on_gpu():
    lin = nn.Linear(512, 256, device="cuda")
    x = torch.randn(3, 32, 512, device="cuda").bfloat16()
    with torch.no_grad():
        y = bench_block.Fp8RowwiseLinear(lin)(x)
        assert y.shape == (3, 32, 256) and rel_err(y, lin(x.float())) < 0.1


@pytest.mark.gpu
@pytest.mark.skipif(kernel_unavailable() is not None, reason="needs a GPU the sm_90 kernels run on")
def test_small_block_every_path_and_mode():
    rows = bench_block.run_block_bench(tokens=256, hidden=512, mlp=1024, heads=4, iters=20, quiet=True)
    modes = [m for m in bench_block.BLOCK_MODES if m not in bench_block.unavailable_modes()]
    assert [(r["method"], r["mode"]) for r in rows] == [(p, m) for p in bench_block.BLOCK_PATHS for m in modes]
    assert all(0 < r["median_ms"] and r["rel_err"] < 0.2 for r in rows), rows
