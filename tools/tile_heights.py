"""Time the int4_pg GEMM alone (CUDA-graph replays, L2 flushed) at the activation-tile heights whose grids take as
many rounds of the SMs as the library's pick, on the 3072-wide layers at M = 4352 and 1024, in one run: the library's
pick (`gemm.tile_choice`), the 224-row tile it picked before 16-row output sub-tiles, and the 208-row tile with a
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
    from w4a4_book import gemm, smem
    p = gemm.example_problem(gemm.find_kernel(None, "int4_pg"), M, N, K, R)
    lib = gemm.default_config("int4_pg", problem=p)
    out = {}
    for name, c in [("w4a4_pg", lib)] + [(n, replace(lib, tile_m=tm, epi_tile_m=et, epi_stages=es))
                                        for n, (tm, et, es) in HEIGHTS.items()]:
        out[name] = (c, smem.solve(gemm.bind(c, p), k=K).stages["main"], -(-M // c.tile_m) * (N // c.tile_n))
    return out


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    import torch
    from w4a4_book.records import provenance, save_record
    rows = []
    for (M, N, K), got in record_cli.time_configs(SHAPES, a.rank, a.iters, configs):
        ref = got["w4a4_pg_224"][2]
        for name, (config, (stages, tiles), out, r) in got.items():
            rows.append(dict(r, tile_m=config.tile_m, epi_tile_m=config.epi_tile_m, epi_stages=config.epi_stages,
                             main_stages=stages, tiles=tiles, equals_224=bool(torch.equal(out, ref))))
            print(f"{M}x{N}x{K} {name} (tile {config.tile_m}, {tiles} tiles, {stages} stages): "
                  f"{r['median_ms'] * 1e3:.1f} us, {r['tflops']:.0f} TFLOP/s, equal {rows[-1]['equals_224']}", flush=True)
    command = record_cli.command("tile_heights.py", a, **OPTIONS)
    prov = provenance(command, [list(s) for s in SHAPES], kind="gemm_tile_heights", rank=a.rank, timing="cuda_graph", fmt="int4_pg")
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
