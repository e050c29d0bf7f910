"""Time the int8-lane activation side (int4_pg and int8) at M = 256 and 4352 in one pass
(`act_quant.quantize_rows_one_pass`, a cluster per row tile, at every cluster that fits) against the two passes (`act_quant.quantize_lora_down`), as CUDA-graph replays with the copy
bandwidth of the same run, check that both write the same codes and bases (and how far apart their `lora_act` are: the two sum the LoRA partials
in different orders), and save a record.

    python tools/one_pass.py --out nbs/data/activation_one_pass_h200.json
"""
import sys

import record_cli

OPTIONS = dict(rank=32, iters=50)   # the numeric options and their defaults

SHAPES = tuple((M, K) for M in (256, 4352) for K in (3840, 10240, 15360))
FORMATS = ("int4_pg", "int8")


def one_pass_bytes(M: int, K: int, R: int, elt: int = 2) -> int:
    "Bytes one pass moves, counted as `bench.layer.activation_bytes` counts each pass: x and smooth in, codes, bases and lora_act out, lora_downᵀ in."
    return M * K * elt + K * elt + M * K + 4 * M + ((M * R * elt + R * K * elt) if R else 0)


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    import torch
    from w4a4_book import act_quant, cache, heuristics
    from w4a4_book.bench.layer import _activation_inputs, activation_bytes, copy_bandwidth
    from w4a4_book.bench.timing import time_cuda
    from w4a4_book.kernels.sm90_quant import QuantLoraDown
    from w4a4_book.records import provenance, save_record
    copy, rows, R, skipped = copy_bandwidth(), [], a.rank, {}
    for (M, K), fmt in ((s, f) for s in SHAPES for f in FORMATS):
        x, smooth, ldt = _activation_inputs(M, K, R)
        act, lora_act = act_quant.quantize_lora_down(x, smooth, ldt, fmt=fmt)
        splits = heuristics.k_splits(-(-M // 64), K // 64, cache.sm_count(torch.cuda.current_device()))
        runs = [("two_pass", None, lambda: act_quant.quantize_lora_down(x, smooth, ldt, fmt=fmt), activation_bytes(M, K, R, fmt, splits))]
        for c in range(2, QuantLoraDown.MAX_CLUSTER + 1):
            if (K // 64) % c == 0 and act_quant.one_pass_smem(K, R, c) <= act_quant.SMEM_PER_BLOCK:
                runs.append(("one_pass", c, lambda c=c: act_quant.quantize_rows_one_pass(x, smooth, ldt, fmt=fmt, cluster=c),
                             one_pass_bytes(M, K, R)))
        for method, c, call, nbytes in runs:
            name = f"{fmt} {M}x{K} {method} cluster {c}"
            try:
                out = call()
            except Exception as e:              # recorded as skipped, with the reason, and the run goes on
                skipped[name] = f"{type(e).__name__}: {e}"[:300]
                print(f"{name}: skipped: {skipped[name]}", flush=True)
                continue
            same = True if c is None else bool(torch.equal(out[0], act.data) and torch.equal(out[1], act.base))
            # lora_act's partials are added in another order (on chip, not RowCodes' butterfly): bf16 outputs may differ by an ulp
            lora_diff = 0.0 if c is None or lora_act is None else (out[2].float() - lora_act.float()).abs().max().item()
            t = time_cuda(call, warmup=10, iters=a.iters, graph=True)
            bw = nbytes / (t["median_ms"] * 1e-3)
            rows.append(dict(method=method, fmt=fmt, M=M, K=K, R=R, cluster=c, k_splits=splits if c is None else c,
                             bytes=nbytes, **t, timing="graph", bandwidth=bw, copy_bandwidth=copy, of_copy=bw / copy,
                             same_codes=same, lora_act_max_diff=lora_diff))
            print(f"{name}: {t['median_ms'] * 1e3:.1f} us, {bw / 1e12:.2f} TB/s = {bw / copy:.0%} of copy"
                  f"{'' if same else ', CODES DIFFER'}", flush=True)
    command = record_cli.command("one_pass.py", a, **OPTIONS)
    prov = provenance(command, [list(s) for s in SHAPES], kind="activation_one_pass", rank=R, formats=list(FORMATS), skipped=skipped)
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
