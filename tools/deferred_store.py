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


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    from dataclasses import replace
    import torch
    from w4a4_book import gemm
    from w4a4_book.bench.timing import time_cuda, tflops
    from w4a4_book.bench.workloads import make_workload
    from w4a4_book.records import provenance, save_record
    rows = []
    for M, N, K in SHAPES:
        w = make_workload(M, N, K, a.rank, fmt="int4_pg")
        lib = gemm.default_config("int4_pg", problem=gemm.example_problem(gemm.find_kernel(None, "int4_pg"), M, N, K, a.rank))
        outs = {}
        for name, config in (("w4a4_pg", lib), ("w4a4_pg_deferred", replace(lib, epi_deferred=True))):
            launch, out = gemm.gemm_launcher(*w.operands, out_dtype=w.out_dtype, config=config)
            launch()
            torch.cuda.synchronize()
            outs[name] = out.clone()
            t = time_cuda(launch, warmup=10, iters=a.iters, graph=True)
            rows.append(dict(method=name, M=M, N=N, K=K, R=a.rank, config=repr(config), **t,
                             tflops=tflops(M, N, K, t["median_ms"]), timing="graph"))
        same = bool(torch.equal(outs["w4a4_pg"], outs["w4a4_pg_deferred"]))
        for r in rows[-2:]:
            r["equals_library"] = same
            print(f"{M}x{N}x{K} {r['method']}: {r['median_ms'] * 1e3:.1f} us, {r['tflops']:.0f} TFLOP/s, equal {same}", flush=True)
    command = record_cli.command("deferred_store.py", a, **OPTIONS)
    prov = provenance(command, [list(s) for s in SHAPES], kind="gemm_deferred_store", rank=a.rank, timing="cuda_graph", fmt="int4_pg")
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
