"""Time the int8-lane activation side (int4_pg and int8) at M = 4352 with its two passes at once
(`gemm.BoundRowsFollow`: a persistent first pass taking the row tiles in order, the second waiting tile by tile) at several
rounds (items a CTA), ring depths and shares (and its first pass alone, with a memset zeroing the counters it leaves final), against the two passes one after the other (`gemm.BoundRows`), as CUDA-graph
replays with the copy bandwidth of the same run; check that both write the same codes and bases, and save a record.

    python tools/follow.py --out nbs/data/activation_follow_h200.json
"""
import sys

import record_cli

OPTIONS = dict(rank=32, iters=50)

SHAPES = tuple((M, K) for M in (4352,) for K in (3840, 10240, 15360))
FORMATS = ("int4_pg",)
CONFIGS = {3840: ((1, 2, 10), (2, 2, 20), (3, 2, 30), (2, 4, 20)),           # (rounds, stages, shares): the grid is the items over the rounds
           10240: ((1, 2, 8), (2, 2, 16), (4, 2, 32), (5, 2, 40), (2, 4, 16)),
           15360: ((1, 2, 8), (2, 2, 16), (3, 2, 24), (5, 2, 40), (2, 4, 16), (4, 2, 30))}


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    import torch
    from w4a4_book import gemm
    from w4a4_book.bench.layer import _activation_inputs, activation_bytes, copy_bandwidth
    from w4a4_book.bench.timing import time_cuda
    from w4a4_book.records import provenance, save_record
    copy, rows, R, skipped = copy_bandwidth(), [], a.rank, {}
    for (M, K), fmt in ((s, f) for s in SHAPES for f in FORMATS if s[0] == 4352 or f == "int4_pg"):
        x, smooth, ldt = _activation_inputs(M, K, R)
        two = gemm.BoundRows(x, smooth, ldt, fmt=fmt)
        codes, base, lora_act = two(x)
        sms = gemm.sm_count(torch.cuda.current_device())
        ks2 = gemm.k_splits(-(-M // 64), K // 64, sms)
        first = gemm.follow_shares(M, K, sms * gemm.FOLLOW_CTAS_PER_SM)
        runs = [("two_pass", ks2, None, None, two)]
        for rounds, stages, ks in CONFIGS[K]:
            try:
                runs.append(("follow", ks, rounds, stages, gemm.BoundRowsFollow(x, smooth, ldt, fmt=fmt, shares=ks, rounds=rounds, stages=stages)))
            except Exception as e:
                skipped[f"{fmt} {M}x{K} follow {rounds} {stages} {ks}"] = f"{type(e).__name__}: {e}"[:300]
        nbytes = activation_bytes(M, K, R, fmt, ks2)          # the two passes' bytes, every pass counted, for both
        for method, ks, rounds, stages, call in runs:
            pieces = [("both", lambda: call(x))]
            if method == "follow":      # the first pass alone: what the persistent schedule costs before the second runs beside it
                t6 = call._tensors(x)
                pieces.append(("first_only_and_memset", lambda: (call.first(x, call.sm, call.ldt, *t6[:4], t6[5]), t6[5].zero_())))
            out = call(x)
            same = bool(torch.equal(out[0], codes) and torch.equal(out[1], base))
            lora_diff = 0.0 if lora_act is None else (out[2].float() - lora_act.float()).abs().max().item()
            for piece, fn in pieces:
                t = time_cuda(fn, warmup=10, iters=a.iters, graph=True)
                bw = nbytes / (t["median_ms"] * 1e-3)
                rows.append(dict(method=method, piece=piece, fmt=fmt, M=M, K=K, R=R, k_splits=ks, rounds=rounds, stages=stages,
                                 bytes=nbytes, **t, timing="graph", bandwidth=bw, copy_bandwidth=copy, of_copy=bw / copy,
                                 same_codes=same, lora_act_max_diff=lora_diff))
                print(f"{fmt} {M}x{K} {method} {piece} shares {ks} rounds {rounds} stages {stages}: {t['median_ms'] * 1e3:.1f} us, "
                      f"{bw / copy:.0%} of copy{'' if same else ', CODES DIFFER'}, lora diff {lora_diff:.1e}", flush=True)
    command = record_cli.command("follow.py", a, **OPTIONS)
    prov = provenance(command, [list(s) for s in SHAPES], kind="activation_follow", rank=R, formats=list(FORMATS), skipped=skipped)
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
