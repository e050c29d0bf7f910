"""Bound the layer whose activation side runs beside its GEMM, on the SMs the GEMM leaves free: at M = 4352, the int4_pg
GEMM on `nsms` persistent CTAs, letting its programmatic dependent launch as soon as every CTA has started, and the
activation side of the same batch (both passes) as that dependent, never waiting for it, so that it runs on the other
SMs. The GEMM reads codes made before the timed calls and the activation writes other buffers: no flag orders them, so
this times the overlap a design with per-row-tile flags could at best reach (a bound, not a layer: its output is not
checked). Timed as CUDA-graph replays in one run with the library's layer, the GEMM alone on `nsms` CTAs, the
activation alone, and torch's compiled FP8 and bf16 layers. An experiment (branch exp/partition), not the library.

    python tools/overlap_partition.py --out nbs/data/layer_h200_overlap_partition.json
"""
import copy, os, sys

import record_cli

OPTIONS = dict(rank=32, iters=30)
SHAPES = ((4352, 3840, 3072), (4352, 3840, 15360), (4352, 15360, 3840), (4352, 10240, 3072))   # M, K, N
NSMS = (120, 108, 96)                 # the GEMM's CTAs; the other 12, 24, 36 SMs are the activation's


def activation_beside(q, x, args, R):
    "A copy of the bound activation `q` whose first pass launches as a programmatic dependent that never waits."
    from w4a4_book import gemm, ops
    from w4a4_book.kernels.sm90_quant import QuantLoraDown
    launch = gemm._quant_setup(x, args[5], ops.lora_down_t(args[6]), "int4_pg", gemm.ACT_STAGES, gemm.ACT_CTAS_PER_SM)
    ks, sig = launch["ks"], launch["sig"]
    rowmax, partial, _, _, codes, codes32 = q._tensors(x.device, False)
    dep = copy.copy(q)
    dep.first = gemm.launchable(("rowmax dependent", *sig), x.device, gemm._quant_compiler(
        lambda: QuantLoraDown(R, gemm.ACT_STAGES, True, ks, mode="pg_rowmax", dependent=True), gemm.QUANT_ARGS,
        [x, q.sm, q.ldt, codes32, rowmax, partial]))
    return dep


def gemm_on(nsms, act, wgt, lora_act, args):
    "The int4_pg GEMM of the layer on `nsms` persistent CTAs (its tile chosen for them), triggering its dependent at start."
    import torch
    import cutlass.cute as cute
    from w4a4_book import gemm, smem
    from w4a4_book.kernels.sm90_pg import W4A4GemmPg

    class TriggerPg(W4A4GemmPg):
        @cute.jit
        def write_lookup(self, st, layouts, tidx):
            cute.arch.griddepcontrol_launch_dependents()
            W4A4GemmPg.write_lookup(self, st, layouts, tidx)

    _, tensors, _, p, _ = gemm._launch(act, wgt, lora_act, args[7], args[8], args[9], torch.bfloat16, None, None)
    config = gemm.tile_choice(gemm.default_config("int4_pg"), p, nsms)
    kern = TriggerPg(smem.solve(gemm.bind(config, p), k=p.K), p, nsms)
    specs = kern.arguments(p)
    return gemm.BoundGemm(gemm.compile_launchable(kern, specs, True), tensors, specs, ()), config.tile_m


def measure(M, K, N, R, iters):
    "One row per `NSMS` and one for the library: GPU times (µs) of each way, all in this run."
    import torch, torch.nn as nn
    from w4a4_book import ops
    from w4a4_book.layers import W4A4Linear
    from w4a4_book.bench.layer import layer_paths
    from w4a4_book.bench.timing import time_cuda
    from w4a4_book.formats import QTensor
    paths, _ = layer_paths(M, K, N, R)
    t = lambda f: time_cuda(f, warmup=10, iters=iters, graph=True)["median_ms"] * 1e3
    base = {name: t(paths[name]) for name in ("torch_bf16", "torch_fp8_compiled", "w4a4_pg")}
    g = torch.Generator(device="cuda").manual_seed(1)
    lin = nn.Linear(K, N, device="cuda")
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    pg = W4A4Linear.from_linear(lin, rank=R, act_sample=x[:256].float(), dtype=torch.bfloat16, backend="sm90", fmt="int4_pg")
    args = pg.op_args(x, "sm90")
    q = ops.BoundLinear(args, None).quantize
    codes, base_a, lora_act = q(x)                       # the GEMM's input, made once
    act = QTensor.trusted(codes, None, "int4_pg", base=base_a)
    wgt = ops.weights(args[1], args[2], "int4_pg", args[3], args[4])
    dep = activation_beside(q, x, args, R)
    act_alone = t(lambda: q(x))
    rows = []
    for nsms in NSMS:
        g_n, tile_m = gemm_on(nsms, act, wgt, lora_act, args)
        out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
        def beside():
            g_n(codes, base_a, lora_act, out)
            dep(x)
        row = dict(M=M, K=K, N=N, R=R, nsms=nsms, tile_m=tile_m, gemm_alone_us=t(lambda: g_n(codes, base_a, lora_act, out)),
                   activation_alone_us=act_alone, beside_us=t(beside), library_us=base["w4a4_pg"],
                   torch_fp8_compiled_us=base["torch_fp8_compiled"], torch_bf16_us=base["torch_bf16"])
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    os.environ["W4A4_BOOK_KERNEL_CACHE"] = "off"         # the GEMMs on fewer CTAs share a cache key with the library's
    from w4a4_book.records import provenance, save_record
    rows = [r for M, K, N in SHAPES for r in measure(M, K, N, a.rank, a.iters)]
    command = record_cli.command("overlap_partition.py", a, **OPTIONS)
    prov = provenance(command, [list(s) for s in SHAPES], kind="layer_overlap_partition", rank=a.rank, timing="cuda_graph",
                      model="a bound: the GEMM and the activation of one batch run side by side, unordered (no flags)")
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
