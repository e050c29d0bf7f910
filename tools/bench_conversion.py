"""Time the conversion of one linear layer on this machine's CPU (`W4A4Linear.from_linear`, int4_pg, smoothed from a
calibration batch) with the low-rank factors from the full SVD and from the randomized SVD that `low_rank` takes for
large weights; by default a FLUX-sized MLP linear, 3072 outputs by 12288 inputs, at rank 32. A benchmark, not a test:
it prints, for each method, the median seconds of `--repeats` conversions and the converted layer's relative output
error against the float layer (the two should agree).

    python tools/bench_conversion.py [--out-features 3072] [--in-features 12288] [--rank 32] [--repeats 3]
"""
import argparse
import statistics
import sys
import time


def layer_and_batch(N: int, K: int, seed: int = 0) -> tuple:
    "A seeded float `nn.Linear(K, N)` with four outlier input columns, and 256 rows of activations with outlier channels."
    import torch
    from torch import nn
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) / K**0.5)
        lin.weight[:, :4] *= 8
        lin.bias.zero_()
    x = torch.randn(256, K, generator=g)
    x[:, 10:14] *= 20
    return lin, x


def time_method(lin, x, rank: int, method: str, repeats: int) -> dict:
    "Median seconds of `from_linear` with `low_rank_method=method`, and the converted layer's relative output error."
    import torch
    from w4a4_book.layers import W4A4Linear
    secs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        layer = W4A4Linear.from_linear(lin, rank=rank, fmt="int4_pg", act_sample=x[:128], low_rank_method=method)
        secs.append(time.perf_counter() - t0)
    with torch.no_grad():
        ref = lin(x[128:])
        err = float((layer(x[128:]).float() - ref).norm() / ref.norm())
    return dict(method=method, median_s=statistics.median(secs), min_s=min(secs), rel_err=err)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-features", type=int, default=3072)
    ap.add_argument("--in-features", type=int, default=12288)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="svd,randomized", help="comma-separated low_rank methods")
    a = ap.parse_args(argv)
    import torch
    lin, x = layer_and_batch(a.out_features, a.in_features)
    print(f"from_linear of a {a.out_features}x{a.in_features} linear at rank {a.rank}, int4_pg, on "
          f"{torch.get_num_threads()} CPU threads, {a.repeats} repeats", flush=True)
    rows = []
    for method in a.methods.split(","):
        rows.append(time_method(lin, x, a.rank, method, a.repeats))
        r = rows[-1]
        print(f"  low_rank_method={method!r}: median {r['median_s']:.2f} s (min {r['min_s']:.2f} s), "
              f"relative output error {r['rel_err']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
