"""Time the int4_pg GEMM alone (CUDA-graph replays, L2 flushed) at each output-ring setting that fits, on the four
M = 4352 layers and on short K at 4352×3072, in one run: what a tile's epilogue costs, from how the time falls with K
and how it moves with the ring (`epi_stages` sub-tiles of `64 × epi_tile_m` in flight per MMA warpgroup). Every
setting's output is checked equal to the library tile's bit for bit (the ring changes where the output waits, not
what it is).

    python tools/epilogue_gemm.py --out nbs/data/epilogue_gemm_h200.json
"""
import sys

import record_cli

OPTIONS = dict(rank=32, iters=30)
SHAPES = ((4352, 3072, 3840), (4352, 15360, 3840), (4352, 3072, 10240), (4352, 3840, 15360))   # M, N, K
# tile_m, epi_tile_m, epi_stages: each shape times those whose grid takes as many rounds of the SMs as its library tile's
RINGS = ((224, 32, 2), (224, 112, 1), (224, 112, 2), (208, 16, 4), (256, 32, 2), (256, 64, 2), (256, 128, 1),
         (256, 64, 1))


def configs(M, N, K, R):
    """`{name: (config, main stages)}` of the library's tile and of each of `RINGS` whose budget fits and whose grid
    takes as many rounds of `heuristics.DEFAULT_NUM_SMS` as the library's."""
    from dataclasses import replace
    from w4a4_book import smem, heuristics, jit, registry
    lib = registry.default_config("int4_pg", problem=jit.example_problem(registry.find_kernel(None, "int4_pg"), M, N, K, R))
    p = jit.example_problem(registry.find_kernel(None, "int4_pg"), M, N, K, R)
    out = {}
    rounds = lambda tm: -(-(-(-M // tm) * (N // lib.tile_n)) // heuristics.DEFAULT_NUM_SMS)
    rings = [(f"tm{tm}_et{et}_es{es}", replace(lib, tile_m=tm, epi_tile_m=et, epi_stages=es, epi_vectors="smem"))
             for tm, et, es in RINGS if rounds(tm) == rounds(lib.tile_m)]
    for name, c in [("w4a4_pg", lib)] + rings:
        try:
            out[name] = (c, smem.solve(heuristics.bind(c, p), k=K).stages["main"])
        except ValueError as e:
            print(f"{M}x{N}x{K} {name}: skipped ({e})", flush=True)
    return out


def rows_of(shape, got) -> list:
    "One shape's rows: each ring's, its main stages and whether its output equals the library's; printed."
    import torch
    rows, ref = [], got["w4a4_pg"][2]
    for name, (config, (stages,), out, r) in got.items():
        rows.append(dict(r, main_stages=stages, equals_library=bool(torch.equal(out, ref))))
        print(f"{'x'.join(map(str, shape))} {name} ({stages} stages): {r['median_ms'] * 1e3:.1f} us, "
              f"{r['tflops']:.0f} TFLOP/s, equal {rows[-1]['equals_library']}", flush=True)
    return rows


def main(argv=None):
    "Measure, print and save the record."
    return record_cli.gemm_tool(__doc__, argv, "epilogue_gemm.py", SHAPES, configs, rows_of, "gemm_epilogue", **OPTIONS)


if __name__ == "__main__":
    sys.exit(main())
