"""Measure where the host time of an eager `W4A4Linear` forward goes on this machine, part by part, and save a record:
the whole forward, the bound op (`ops.bound_linear`), the bound plan, its activation side, its GEMM launch alone, and
the torch primitives a forward pays for (an allocation, a zeroed buffer, an empty module call).

    python tools/host_parts.py --out nbs/data/host_parts_h200.json
"""
import sys, time

import record_cli

OPTIONS = dict(rank=32, iters=2000)   # the numeric options and their defaults

SHAPES = ((256, 3840, 3072),)           # (M, K, N): host time does not depend on M; a small M keeps the GPU ahead
LAYERS = (("int4_pg", None), ("int4_pg", "int8"))   # (weights' fmt, act_fmt): the formats whose op binds


def host_us(fns: dict, iters: int, rounds: int = 20, sync_every: int = 8) -> dict:
    """Median, p10 and p90 host µs per call of each of `fns` (key -> function), `iters` calls each, taken in `rounds`
    interleaved rounds so that a slow spell of the machine falls on every part alike. The GPU is synchronised every
    `sync_every` calls, outside the times, so that a full launch queue never makes a call wait."""
    import torch
    for fn in fns.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            ts = times[name]
            for i in range(iters // rounds):
                t0 = time.perf_counter_ns()
                fn()
                ts.append((time.perf_counter_ns() - t0) / 1e3)
                if i % sync_every == sync_every - 1:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name] = dict(median_us=ts[len(ts) // 2], p10_us=ts[len(ts) // 10], p90_us=ts[9 * len(ts) // 10], n=len(ts))
    return out


def parts(layer, x) -> dict:
    "The calls timed for one layer and input: name -> function of no arguments."
    import torch
    from w4a4_book import ops, cache
    layer(x)
    args = layer.op_args(x, "sm90")
    plan = cache.kept(layer.qweight_data)["bound linear"][(x.shape[0], x.dtype, x.device)]
    codes, base, lora_act = plan.quantize(x)
    out = torch.empty(plan.shape, dtype=plan.dtype, device=x.device)
    ident = torch.nn.Identity()
    return {"forward": lambda: layer(x), "op_args": lambda: layer.op_args(x, "sm90"),
            "bound_linear": lambda: ops.bound_linear(args), "plan": lambda: plan(x),
            "activation side": lambda: plan.quantize(x, workspace=True), "gemm launch": lambda: plan._launch(codes, base, lora_act, out),
            "torch.empty": lambda: torch.empty(x.shape, dtype=torch.int8, device=x.device),
            "torch.zeros": lambda: torch.zeros(x.shape[0], dtype=torch.int32, device=x.device),
            "nn.Identity call": lambda: ident(x)}


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    import torch
    from w4a4_book.layers import W4A4Linear
    from w4a4_book.records import provenance, save_record
    rows, dev = [], torch.device("cuda")
    for M, K, N in SHAPES:
        torch.manual_seed(0)
        lin, x = torch.nn.Linear(K, N, device=dev), torch.randn(M, K, device=dev).bfloat16()
        layers = {(fmt, act_fmt or fmt): W4A4Linear.from_linear(lin, rank=a.rank, dtype=torch.bfloat16, backend="sm90",
                                                                fmt=fmt, act_fmt=act_fmt) for fmt, act_fmt in LAYERS}
        with torch.no_grad():   # every layer's parts in the same interleaved rounds: a slow spell falls on all alike
            fns = {(fa, part): fn for fa, layer in layers.items() for part, fn in parts(layer, x).items()}
            for ((fmt, act_fmt), part), t in host_us(fns, a.iters).items():
                rows.append(dict(part=part, fmt=fmt, act_fmt=act_fmt, M=M, K=K, N=N, R=a.rank, **t))
                print(f"{fmt}/{act_fmt} M={M}: {part:16s} {t['median_us']:7.2f} us", flush=True)
    command = record_cli.command("host_parts.py", a, **OPTIONS)
    prov = provenance(command, [list(s) for s in SHAPES], kind="host_parts", rank=a.rank)
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
