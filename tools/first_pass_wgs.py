"""Time the int8-lane activation side's two passes (`gemm.BoundRows`, int4_pg) with the first pass at several CTAs per
SM (its shares of K, `gemm.k_splits`), ring depths and warpgroups a CTA (`warpgroups`: warpgroup w takes K-blocks
w, w + warpgroups, ... of the share), at M = 4352 and 256, as CUDA-graph replays with the copy bandwidth of the same
run; check every point writes the defaults' codes and bases (and how far its `lora_act` is from theirs), and save a record.

    python tools/first_pass_wgs.py --out nbs/data/activation_first_pass_wgs_h200.json
"""
import sys

import record_cli

OPTIONS = dict(rank=32, iters=50)
SHAPES = tuple((M, K) for M in (4352, 256) for K in (3840, 10240, 15360))
GRID = ((4, 2, 1), (4, 2, 2), (4, 4, 2), (2, 4, 2), (2, 2, 2), (2, 4, 4), (1, 4, 2), (8, 2, 1))   # (CTAs per SM, stages, warpgroups); first: the defaults


def main(argv=None, shapes=SHAPES, grid=GRID, script="first_pass_wgs.py", doc=__doc__):
    "Measure `grid` at `shapes` (the first point the library's defaults), print and save the record."
    a = record_cli.parse(doc, argv, **OPTIONS)
    import torch
    from w4a4_book import gemm
    from w4a4_book.bench.layer import _activation_inputs, activation_bytes, copy_bandwidth
    from w4a4_book.bench.timing import time_cuda
    from w4a4_book.records import provenance, save_record
    assert grid[0] == (gemm.ACT_CTAS_PER_SM, gemm.ACT_STAGES, gemm.ACT_WARPGROUPS), "the first point is the library's"
    copy, rows, R, fmt, skipped = copy_bandwidth(), [], a.rank, "int4_pg", {}
    sms = gemm.sm_count(torch.cuda.current_device())
    for M, K in shapes:
        x, smooth, ldt = _activation_inputs(M, K, R)
        ref = None
        for cps, stages, wgs in grid:
            name = f"{M}x{K} {cps} CTAs/SM, {stages} stages, {wgs} warpgroups"
            try:
                bound = gemm.BoundRows(x, smooth, ldt, fmt=fmt, stages=stages, ctas_per_sm=cps, warpgroups=wgs)
            except Exception as e:             # recorded as skipped, with the reason, and the run goes on
                skipped[name] = f"{type(e).__name__}: {e}"[:300]
                continue
            out = bound(x)
            ref = ref or out
            same = bool(torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]))
            # lora_act's partials are added in another order (other shares, or warpgroups on alternate K-blocks): bf16 may differ by an ulp
            lora_diff = (out[2].float() - ref[2].float()).abs().max().item()
            ks = gemm.k_splits(-(-M // 64), K // 64, sms, cps)
            nbytes = activation_bytes(M, K, R, fmt, ks)
            t = time_cuda(lambda: bound(x), warmup=10, iters=a.iters, graph=True)
            bw = nbytes / (t["median_ms"] * 1e-3)
            rows.append(dict(fmt=fmt, M=M, K=K, R=R, ctas_per_sm=cps, stages=stages, warpgroups=wgs, k_splits=ks, bytes=nbytes, **t,
                             timing="graph", bandwidth=bw, copy_bandwidth=copy, of_copy=bw / copy, same_codes=same, lora_act_max_diff=lora_diff,
                             default=(cps, stages, wgs) == grid[0]))
            print(f"{name}: {t['median_ms'] * 1e3:.1f} us, {bw / copy:.0%} of copy{'' if same else ', CODES DIFFER'}, lora diff {lora_diff:.1e}", flush=True)
    command = record_cli.command(script, a, **OPTIONS)
    prov = provenance(command, [list(s) for s in shapes], kind="activation_first_pass_wgs", rank=R, formats=[fmt], skipped=skipped)
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
