"""Time the int4_pg layer at M = 4352 with its GEMM on the stream-K schedule (`smem.HopperPgStreamKConfig`, the 256-row
tile) and on the tail split (`smem.HopperPgSplitTailConfig`) against the same layer with the library's GEMM and torch's compiled FP8 and bf16 layers, all as CUDA-graph
replays in one run, and check the two int4_pg layers' outputs are equal bit for bit.

    python tools/stream_k.py --out nbs/data/layer_h200_stream_k.json
"""
import copy, sys

import record_cli

OPTIONS = dict(rank=32, iters=30)
SHAPES = ((4352, 3840, 3072), (4352, 3840, 15360), (4352, 15360, 3840), (4352, 10240, 3072))   # M, K, N


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    import torch
    from w4a4_book import smem
    from w4a4_book.bench.layer import layer_paths
    from w4a4_book.bench.timing import time_cuda
    from w4a4_book.records import provenance, save_record
    rows = []
    for M, K, N in SHAPES:
        paths, _ = layer_paths(M, K, N, a.rank)
        lib = paths["w4a4_pg"]
        free = dict(zip(lib.__code__.co_freevars, (c.cell_contents for c in lib.__closure__)))   # its path is `lambda: pg(x)`
        pg, x = free["pg"], free["x"]                    # the layer `layer_paths` converted, and its input
        sk, st = copy.deepcopy(pg), copy.deepcopy(pg)
        sk.kernel_config, st.kernel_config = smem.HopperPgStreamKConfig(), smem.HopperPgSplitTailConfig()
        y_lib, y_sk, y_st = pg(x).clone(), sk(x).clone(), st(x).clone()
        t = {name: time_cuda(f, warmup=10, iters=a.iters, graph=True)["median_ms"] for name, f in
             (("torch_bf16", paths["torch_bf16"]), ("torch_fp8_compiled", paths["torch_fp8_compiled"]),
              ("w4a4_pg", lambda: pg(x)), ("w4a4_pg_stream_k", lambda: sk(x)), ("w4a4_pg_split_tail", lambda: st(x)))}
        row = dict(M=M, K=K, N=N, R=a.rank, **{f"{k}_ms": v for k, v in t.items()}, same_output=bool(torch.equal(y_lib, y_sk)), split_tail_same=bool(torch.equal(y_lib, y_st)),
                   max_diff=(y_lib.float() - y_sk.float()).abs().max().item())
        print({k: (round(v * 1e3, 1) if k.endswith("_ms") else v) for k, v in row.items()},
              f"stream-K over compiled FP8 {t['torch_fp8_compiled'] / t['w4a4_pg_stream_k']:.2f}x, tail split {t['torch_fp8_compiled'] / t['w4a4_pg_split_tail']:.2f}x, "
              f"library {t['torch_fp8_compiled'] / t['w4a4_pg']:.2f}x", flush=True)
        rows.append(row)
    command = record_cli.command("stream_k.py", a, **OPTIONS)
    prov = provenance(command, [list(s) for s in SHAPES], kind="layer_stream_k", rank=a.rank, timing="cuda_graph")
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
