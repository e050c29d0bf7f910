"""Time the int4_pg activation side's pieces at M = 4352 in the harness `bench-layer --activation` uses (one CUDA-graph
replay per call, L2 flushed before each): the first pass alone, the second pass alone, both; beside them a graph of
one tiny kernel (the harness's floor) and a device copy moving the same bytes as the two passes count, so that the
share of the copy bandwidth the two passes reach can be read against what a copy of their size reaches; and save a record.

    python tools/activation_floor.py --out nbs/data/activation_floor_h200.json
"""
import sys

import record_cli

OPTIONS = dict(rank=32, iters=50)   # the numeric options and their defaults

SHAPES = tuple((4352, K) for K in (3840, 10240, 15360))


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    import torch
    from w4a4_book import act_quant, cache, heuristics
    from w4a4_book.bench.layer import _activation_inputs, activation_bytes, copy_bandwidth
    from w4a4_book.bench.timing import time_cuda
    from w4a4_book.records import provenance, save_record
    copy, rows, R = copy_bandwidth(), [], a.rank
    tiny = torch.zeros(1, device="cuda")
    floor = time_cuda(lambda: tiny.add_(1), warmup=10, iters=a.iters, graph=True)
    rows.append(dict(piece="one_tiny_kernel", M=0, K=0, R=R, bytes=0, **floor, timing="graph"))
    for M, K in SHAPES:
        x, smooth, ldt = _activation_inputs(M, K, R)
        bound = act_quant.bind_quantize_rows(x, smooth, ldt, fmt="int4_pg")
        rowmax, partial, base, lora_act, _, codes32 = bound._tensors(x.device, False)
        splits = heuristics.k_splits(-(-M // 64), K // 64, cache.sm_count(torch.cuda.current_device()))
        nbytes = activation_bytes(M, K, R, "int4_pg", splits)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        pieces = (("first_pass", lambda: bound.first(x, bound.sm, bound.ldt, codes32, rowmax, partial)),
                  ("second_pass", lambda: bound.second(x, bound.sm, rowmax, codes32, base, partial, lora_act)),
                  ("two_passes", lambda: bound(x)),
                  ("copy_of_the_same_bytes", lambda: dst.copy_(src)))
        for piece, call in pieces:
            call()
            t = time_cuda(call, warmup=10, iters=a.iters, graph=True)
            row = dict(piece=piece, M=M, K=K, R=R, k_splits=splits, **t, timing="graph", copy_bandwidth=copy)
            if piece in ("two_passes", "copy_of_the_same_bytes"):      # the bytes the two passes count, moved either way
                row["bytes"], row["bandwidth"] = nbytes, nbytes / (t["median_ms"] * 1e-3)
                row["of_copy"] = row["bandwidth"] / copy
            rows.append(row)
            print(f"{M}x{K} {piece}: {t['median_ms'] * 1e3:.1f} us" + (f", {row['of_copy']:.0%} of copy" if "bytes" in row else ""), flush=True)
    command = record_cli.command("activation_floor.py", a, **OPTIONS)
    prov = provenance(command, [list(s) for s in SHAPES], kind="activation_floor", rank=R)
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
