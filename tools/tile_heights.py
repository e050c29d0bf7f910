"""Time the int4_pg GEMM alone (CUDA-graph replays, L2 flushed) at the activation-tile heights whose grids take as
many rounds of the SMs as the library's pick, on the 3072-wide layers at M = 4352 and 1024, in one run: the library's
pick (`heuristics.tile_choice`), the 224-row tile it picked before 16-row output sub-tiles, and the 208-row tile with a
deeper output ring. Every output is checked equal to the 224-row tile's bit for bit (the height changes which CTA
computes an element, not what it computes).

    python tools/tile_heights.py --out nbs/data/tile_heights_h200.json
"""
import sys

import record_cli

OPTIONS = dict(rank=32, iters=30)
SHAPES = ((4352, 3072, 3840), (4352, 3072, 10240), (1024, 3072, 3840), (1024, 3072, 10240))   # M, N, K
HEIGHTS = {"w4a4_pg_224": (224, 32, 2), "w4a4_pg_208_es4": (208, 16, 4)}               # tile_m, epi_tile_m, epi_stages


def configs(M, N, K, R):
    "`{name: (config, main stages, tiles)}`: the library's pick, then `HEIGHTS`."
    from dataclasses import replace
    from w4a4_book import smem, heuristics, jit, registry
    p = jit.example_problem(registry.find_kernel(None, "int4_pg"), M, N, K, R)
    lib = registry.default_config("int4_pg", problem=p)
    out = {}
    for name, c in [("w4a4_pg", lib)] + [(n, replace(lib, tile_m=tm, epi_tile_m=et, epi_stages=es))
                                        for n, (tm, et, es) in HEIGHTS.items()]:
        out[name] = (c, smem.solve(heuristics.bind(c, p), k=K).stages["main"], -(-M // c.tile_m) * (N // c.tile_n))
    return out


def rows_of(shape, got) -> list:
    "One shape's rows: each height's, its main stages and tiles, and whether its output equals the 224-row tile's; printed."
    import torch
    rows, ref = [], got["w4a4_pg_224"][2]
    for name, (config, (stages, tiles), out, r) in got.items():
        rows.append(dict(r, main_stages=stages, tiles=tiles, equals_224=bool(torch.equal(out, ref))))
        print(f"{'x'.join(map(str, shape))} {name} (tile {config.tile_m}, {tiles} tiles, {stages} stages): "
              f"{r['median_ms'] * 1e3:.1f} us, {r['tflops']:.0f} TFLOP/s, equal {rows[-1]['equals_224']}", flush=True)
    return rows


def main(argv=None):
    "Measure, print and save the record."
    return record_cli.gemm_tool(__doc__, argv, "tile_heights.py", SHAPES, configs, rows_of, "gemm_tile_heights", **OPTIONS)


if __name__ == "__main__":
    sys.exit(main())
