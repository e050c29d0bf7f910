"""The command line the record tools share: `--out` and the tool's numeric options, and the command a record names
(only the options that differ from their defaults, the output under nbs/data/)."""
import argparse, sys
from pathlib import Path


def parse(doc: str, argv, **defaults) -> argparse.Namespace:
    "`--out PATH` and `--NAME` (an int, default `defaults[NAME]`) for each of `defaults`; puts this checkout on sys.path."
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    for name, value in defaults.items():
        ap.add_argument(f"--{name}", type=int, default=value)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    return a


def command(script: str, a: argparse.Namespace, **defaults) -> str:
    "The command line that re-measures `a`'s record: `python tools/SCRIPT --out nbs/data/NAME` and the options not at their defaults."
    return f"python tools/{script} --out nbs/data/{a.out.name}" + "".join(
        f" --{name} {getattr(a, name)}" for name, value in defaults.items() if getattr(a, name) != value)


def time_configs(shapes, rank: int, iters: int, configs):
    """For each `(M, N, K)` of `shapes`, one int4_pg workload of rank `rank`, and on it each entry of
    `configs(M, N, K, rank)`, `{name: config}` or `{name: (config, *extra)}`: the GEMM launched once (its output kept),
    then timed as CUDA-graph replays with the L2 flushed. Yields `((M, N, K), {name: (config, extra, out, row)})`,
    `row` the record's row (method, shape, rank, config and its tile, the timing, TFLOP/s)."""
    import torch
    from w4a4_book import gemm
    from w4a4_book.bench.timing import time_cuda, tflops
    from w4a4_book.bench.workloads import make_workload
    for M, N, K in shapes:
        w, got = make_workload(M, N, K, rank, fmt="int4_pg"), {}
        for name, entry in configs(M, N, K, rank).items():
            config, *extra = entry if isinstance(entry, tuple) else (entry,)
            launch, out = gemm.gemm_launcher(*w.operands, out_dtype=w.out_dtype, config=config)
            launch()
            torch.cuda.synchronize()
            kept = out.clone()
            t = time_cuda(launch, warmup=10, iters=iters, graph=True)
            tile = {f: getattr(config, f) for f in ("tile_m", "epi_tile_m", "epi_stages")}
            got[name] = (config, extra, kept, dict(method=name, M=M, N=N, K=K, R=rank, config=repr(config), **tile, **t,
                                                   tflops=tflops(M, N, K, t["median_ms"]), timing="graph"))
        yield (M, N, K), got


def gemm_tool(doc: str, argv, script: str, shapes, configs, rows_of, kind: str, **options):
    """A GEMM-alone tool's run: its command line (`parse`, `options` with `rank` and `iters`), `time_configs` over
    `shapes` and `configs`, each shape's rows from `rows_of((M, N, K), got)` (which prints them), and the record saved
    with its provenance (`kind`, CUDA-graph timing, int4_pg)."""
    a = parse(doc, argv, **options)
    from w4a4_book.records import provenance, save_record
    rows = []
    for shape, got in time_configs(shapes, a.rank, a.iters, configs):
        rows += rows_of(shape, got)
    prov = provenance(command(script, a, **options), [list(s) for s in shapes], kind=kind, rank=a.rank,
                      timing="cuda_graph", fmt="int4_pg")
    print(f"saved {save_record(a.out, prov, rows)}")
