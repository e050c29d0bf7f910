"""Time the int4_pg GEMM alone (CUDA-graph replays, L2 flushed) with and without `epi_deferred` on the library's tile
of each M = 4352 layer, in one run: a tile's finished output held in registers and stored while the next tile's first
K-block runs, against the epilogue that stores it before the next K-loop starts. Every held output is checked equal
to the library's bit for bit.

    python tools/deferred_store.py --out nbs/data/deferred_store_h200.json
"""
import sys

import record_cli

OPTIONS = dict(rank=32, iters=30)
SHAPES = ((4352, 3072, 3840), (4352, 15360, 3840), (4352, 3072, 10240), (4352, 3840, 15360))   # M, N, K


def configs(M, N, K, R):
    "`{name: config}`: the library's tile storing each tile before the next K-loop, and the same with `epi_deferred`."
    from dataclasses import replace
    from w4a4_book import jit, registry
    lib = registry.default_config("int4_pg", problem=jit.example_problem(registry.find_kernel(None, "int4_pg"), M, N, K, R))
    return dict(w4a4_pg=replace(lib, epi_deferred=False), w4a4_pg_deferred=replace(lib, epi_deferred=True))


def rows_of(shape, got) -> list:
    "One shape's rows, each with whether the held output equals the library's; printed."
    import torch
    same = bool(torch.equal(got["w4a4_pg"][2], got["w4a4_pg_deferred"][2]))
    rows = [dict(r, equals_library=same) for _, _, _, r in got.values()]
    for r in rows:
        print(f"{'x'.join(map(str, shape))} {r['method']}: {r['median_ms'] * 1e3:.1f} us, {r['tflops']:.0f} TFLOP/s, equal {same}", flush=True)
    return rows


def main(argv=None):
    "Measure, print and save the record."
    return record_cli.gemm_tool(__doc__, argv, "deferred_store.py", SHAPES, configs, rows_of, "gemm_deferred_store", **OPTIONS)


if __name__ == "__main__":
    sys.exit(main())
