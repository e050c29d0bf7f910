"""Time the int8-lane activation side's two passes (`gemm.BoundRows`, int4_pg) at M = 4352 with the second pass's rows
cut in more pieces than `RowCodes.per_row` gives by default (its `WARPS`, the code warps a launch wants, and
`MAX_TRIPS`, the longest piece, set on the class and the kernels compiled anew for each), as CUDA-graph replays with
the copy bandwidth of the same run; check every setting writes the default's codes and bases, and save a record.

    W4A4_BOOK_KERNEL_CACHE=off python tools/row_pieces.py --out nbs/data/activation_row_pieces_h200.json
"""
import sys

import record_cli

OPTIONS = dict(rank=32, iters=50)
M = 4352
KS = (3840, 10240, 15360)
SETTINGS = ((4096, 10), (8704, 10), (13056, 10), (17408, 10), (4096, 4), (4096, 2))   # (WARPS, MAX_TRIPS); first: the defaults


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    import os
    import torch
    from w4a4_book import gemm
    from w4a4_book.bench.layer import _activation_inputs, activation_bytes, copy_bandwidth
    from w4a4_book.bench.timing import time_cuda
    from w4a4_book.kernels.sm90_quant import RowCodes
    from w4a4_book.records import provenance, save_record
    if gemm.kernel_cache_dir() is not None:
        raise SystemExit("set W4A4_BOOK_KERNEL_CACHE=off: each setting compiles the second pass anew")
    assert (RowCodes.WARPS, RowCodes.MAX_TRIPS) == SETTINGS[0], "the first setting is the library's"
    copy, rows, R, fmt = copy_bandwidth(), [], a.rank, "int4_pg"
    sms = gemm.sm_count(torch.cuda.current_device())
    for K in KS:
        x, smooth, ldt = _activation_inputs(M, K, R)
        ks = gemm.k_splits(-(-M // 64), K // 64, sms)
        nbytes = activation_bytes(M, K, R, fmt, ks)
        ref = None
        for warps, trips in SETTINGS:
            RowCodes.WARPS, RowCodes.MAX_TRIPS = warps, trips
            gemm._compiled.clear()
            bound = gemm.BoundRows(x, smooth, ldt, fmt=fmt)
            out = bound(x)
            ref = ref or out
            same = bool(torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]) and torch.equal(out[2], ref[2]))
            t = time_cuda(lambda: bound(x), warmup=10, iters=a.iters, graph=True)
            per_row = RowCodes(fmt).per_row(M, K)
            bw = nbytes / (t["median_ms"] * 1e-3)
            rows.append(dict(fmt=fmt, M=M, K=K, R=R, k_splits=ks, warps=warps, max_trips=trips, per_row=per_row, bytes=nbytes, **t,
                             timing="graph", bandwidth=bw, copy_bandwidth=copy, of_copy=bw / copy, same_codes=same,
                             default=(warps, trips) == SETTINGS[0]))
            print(f"K={K} WARPS {warps} MAX_TRIPS {trips} (pieces a row {per_row}): {t['median_ms'] * 1e3:.1f} us, {bw / copy:.0%} of copy"
                  f"{'' if same else ', OUTPUT DIFFERS'}", flush=True)
        RowCodes.WARPS, RowCodes.MAX_TRIPS = SETTINGS[0]
    command = "W4A4_BOOK_KERNEL_CACHE=off " + record_cli.command("row_pieces.py", a, **OPTIONS)
    prov = provenance(command, [[M, K] for K in KS], kind="activation_row_pieces", rank=R, formats=[fmt])
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
