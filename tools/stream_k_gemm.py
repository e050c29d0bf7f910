"""Time the int4_pg GEMM alone (CUDA-graph replays, L2 flushed) on the stream-K schedule (`smem.HopperPgStreamKConfig`)
against the 256-row whole-tile kernel it cuts up and the library's default tile, and on the library's tile too, in one
run, and check each stream-K output equals its whole-tile kernel's bit for bit. The last shape is a control: its 264 tiles of 256 rows are two whole
rounds of 132 CTAs, so stream-K keeps every tile whole there and should time as the 256-row kernel does.

    python tools/stream_k_gemm.py --out nbs/data/stream_k_gemm_h200.json
"""
import sys

import record_cli

OPTIONS = dict(rank=32, iters=30)
SHAPES = ((4352, 3072, 3840), (4352, 3072, 10240), (4352, 3840, 15360), (3072, 2816, 3840))   # M, N, K


def configs(M, N, K, R):
    """`{name: config}` of the kernels timed at one shape: the library's tile, the 256-row one, and stream-K on each
    (`w4a4_pg_sk` on the 256-row tile, `w4a4_pg_sk_lib` on the library's)."""
    from w4a4_book import smem, jit, registry
    lib = registry.default_config("int4_pg", problem=jit.example_problem(registry.find_kernel(None, "int4_pg"), M, N, K, R))
    same = dict(tile_m=lib.tile_m, epi_tile_m=lib.epi_tile_m, epi_stages=lib.epi_stages, epi_vectors=lib.epi_vectors)
    return dict(w4a4_pg=lib, w4a4_pg_256=smem.HopperPgConfig(tile_m=256, epi_vectors="smem"),
                w4a4_pg_sk=smem.HopperPgStreamKConfig(), w4a4_pg_sk_lib=smem.HopperPgStreamKConfig(**same))


def rows_of(shape, got) -> list:
    "One shape's rows, each with whether stream-K's output equals its whole-tile kernel's (on both tiles); printed."
    import torch
    outs = {name: out for name, (_, _, out, _) in got.items()}
    same = bool(torch.equal(outs["w4a4_pg_sk"], outs["w4a4_pg_256"]))
    same_lib = bool(torch.equal(outs["w4a4_pg_sk_lib"], outs["w4a4_pg"]))
    rows, at = [], "x".join(map(str, shape))
    for name, (_, _, _, r) in got.items():
        rows.append(dict(r, sk_equals_256=same, sk_lib_equals_lib=same_lib))
        print(f"{at} {name}: {r['median_ms'] * 1e3:.1f} us, {r['tflops']:.0f} TFLOP/s", flush=True)
    print(f"{at}: stream-K output equals its whole-tile kernel's: 256 rows {same}, the library's tile {same_lib}", flush=True)
    return rows


def main(argv=None):
    "Measure, print and save the record."
    return record_cli.gemm_tool(__doc__, argv, "stream_k_gemm.py", SHAPES, configs, rows_of, "gemm_stream_k", **OPTIONS)


if __name__ == "__main__":
    sys.exit(main())
