"Tests of the accuracy experiment in `w4a4_book.accuracy` (small sizes; the chapter runs the full one)."
import pytest
import torch

from w4a4_book.accuracy import (DISTRIBUTIONS, METHODS, MASSIVE_SCALE, N_MASSIVE_CHANNELS, N_OUTLIER_CHANNELS,
                                OUTLIER_SCALE, accuracy_table, activations, bits_per_value, plot_accuracy,
                                quantized_weights, rel_err, svdquant_output, svdquant_splits, weights)
from w4a4_book.formats import QTensor, quantize

SMALL = dict(M=32, K=256, N=64, ranks=(0, 16))


@pytest.fixture(scope="module")
def small_rows():
    return accuracy_table(**SMALL)


def test_table_shape_and_yardstick(small_rows):
    assert len(small_rows) == len(DISTRIBUTIONS) * 2 * len(METHODS)
    assert set(small_rows[0]) == {"distribution", "rank", "method", "rel_err", "vs_int4"}
    for r in small_rows:
        assert 0 < r["rel_err"] < 1
        if r["method"] == "int4":
            assert r["vs_int4"] == 1.0
    assert {r["distribution"] for r in small_rows} == set(DISTRIBUTIONS)


def test_table_is_deterministic(small_rows):
    assert accuracy_table(**SMALL) == small_rows


def test_method_subset_keeps_int4():
    rows = accuracy_table(M=16, K=128, N=32, ranks=(16,), methods=("w4a8",))
    assert [r["method"] for r in rows[:2]] == ["int4", "w4a8"] and len(rows) == 2 * len(DISTRIBUTIONS)


def test_splits_are_exact_without_quantization():
    x, w = activations("llm_like", 64, 256, seed=2), weights(48, 256, seed=2)
    ref = x.double() @ w.double().T
    for r, s in svdquant_splits(x, w, (0, 16, 32)).items():
        xh = x / s["smooth"]
        assert rel_err(xh @ s["residual"].T + (xh @ s["down"]) @ s["up"].T, ref) < 1e-5
        assert s["up"].shape == (48, r) and s["down"].shape == (256, r)


def test_output_uses_the_methods_formats():
    x, w = activations("gaussian", 32, 128, seed=1), weights(16, 128, seed=1)
    s = svdquant_splits(x, w, (16,))[16]
    wq = quantized_weights(s["residual"])
    assert wq["int4"].fmt == "int4" and wq["w4a8"].fmt == "int4_pg" and wq["int4_pg from int4, keep codes"].fmt == "int4_pg"
    for m in METHODS:
        y = svdquant_output(x, s, m, wq[m])
        assert y.shape == (32, 16) and rel_err(y, x.double() @ w.double().T) < 0.5


def test_distributions_are_as_defined():
    x = activations("outlier_channels", 4096, 512, seed=0)
    std = x.std(0)
    big = std > 10
    assert big.sum().item() == N_OUTLIER_CHANNELS
    assert abs(std[big].mean().item() / std[~big].mean().item() - OUTLIER_SCALE) < 2
    y = activations("llm_like", 4096, 512, seed=0)
    s = y.std(0)
    top = s.topk(N_MASSIVE_CHANNELS).values
    assert (top / s.median() > MASSIVE_SCALE / 2).all() and top.max() / top.min() < 1.1     # 8 channels, one magnitude
    t = activations("student_t3", 4096, 64, seed=0)
    assert abs(t.var().item() - 3) < 1.5 and t.abs().max().item() > 20       # variance 3, heavy tails
    g = activations("gaussian", 4096, 64, seed=0)
    assert abs(g.std().item() - 1) < 0.02
    assert not torch.equal(activations("gaussian", 4, 64, seed=0), activations("gaussian", 4, 64, seed=1))


def test_bits_per_value():
    x = torch.randn(8, 1024)
    assert bits_per_value(quantize(x, "int4")) == 4 + 16 / 64
    assert bits_per_value(quantize(x, "int4_pg")) == 4 + 8 / 64 + 32 / 1024
    assert bits_per_value(quantize(x, "int4_pg").as_int8()) == 8 + 8 / 64 + 32 / 1024
    assert bits_per_value(quantize(x, "int8")) == 8 + 32 / 1024
    assert bits_per_value(quantize(x, "nvfp4")) == 4 + 8 / 16 + 32 / (8 * 1024)


def test_plot(small_rows):
    fig = plot_accuracy(small_rows, title="t")
    assert len(fig.axes) == len(DISTRIBUTIONS)


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: accuracy_table(M=0), ValueError, "M=0 must be >= 1"),
    (lambda: accuracy_table(K=100), ValueError, "K=100 must be a multiple of 64"),
    (lambda: accuracy_table(N=2.5), TypeError, "N must be an int"),
    (lambda: accuracy_table(ranks=()), TypeError, "ranks must be a non-empty tuple"),
    (lambda: accuracy_table(M=8, K=64, N=16, ranks=(8,)), ValueError, "rank=8 must be a multiple of 16"),
    (lambda: accuracy_table(M=8, K=64, N=16, ranks=(32,)), ValueError, r"at most min\(N, K\) = 16"),
    (lambda: accuracy_table(methods=("fp8",)), ValueError, "unknown: \\['fp8'\\]"),
    (lambda: accuracy_table(methods=()), ValueError, "methods must be a non-empty selection"),
    (lambda: activations("cauchy", 4, 64), ValueError, "dist='cauchy' must be one of"),
    (lambda: activations("gaussian", 4, 64, seed=-1), ValueError, "seed=-1 must be >= 0"),
    (lambda: weights(0, 64), ValueError, "N=0 must be >= 1"),
    (lambda: bits_per_value(torch.zeros(2)), TypeError, "q must be a QTensor"),
    (lambda: bits_per_value(quantize(torch.zeros(0, 64), "int4")), ValueError, "no elements"),
    (lambda: plot_accuracy({}), TypeError, "rows must be a non-empty list of dicts"),
])
def test_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()
