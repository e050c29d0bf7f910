"""Time the int4_pg layer at M = 4352 (CUDA-graph replays, L2 flushed) three ways in one run: as the library runs it;
in two halves of M, one after the other; and in two halves with the second half's activation a programmatic
dependent of the first half's GEMM, which runs on fewer CTAs (`SPARE`) and lets it launch at its start, so that the
activation runs on the SMs the GEMM leaves free. An experiment (branch exp/overlap-halves), not the library.

    python tools/overlap_halves.py --out nbs/data/layer_h200_overlap_halves.json
"""
import argparse, os, sys, copy, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["W4A4_BOOK_KERNEL_CACHE"] = "off"       # the GEMMs below share a cache key with the library's
import torch, torch.nn as nn
import cutlass.cute as cute
from w4a4_book import gemm, ops, smem
from w4a4_book.layers import W4A4Linear
from w4a4_book.formats import QTensor
from w4a4_book.bench.timing import time_cuda
from w4a4_book.kernels.sm90_pg import W4A4GemmPg
from w4a4_book.kernels.sm90_quant import QuantLoraDown
from w4a4_book.records import provenance, save_record

# (M, K, N, CTAs of the first half's GEMM): the GEMM of 480 tiles takes 4 rounds on 120 CTAs as on 132
SHAPES = ((4352, 10240, 3072, 120), (4352, 3840, 3072, 120), (4352, 15360, 3840, 128), (4352, 3840, 15360, 128))

class TriggerPg(W4A4GemmPg):
    "The int4_pg GEMM, letting its programmatic dependent launch as soon as every CTA has started."
    @cute.jit
    def write_lookup(self, st, layouts, tidx):
        cute.arch.griddepcontrol_launch_dependents()
        W4A4GemmPg.write_lookup(self, st, layouts, tidx)

def measure(M, K, N, nsms, iters):
    "One row: the three ways' times, and how far the halves' outputs are from the library's."
    g = torch.Generator(device="cuda").manual_seed(0)
    lin = nn.Linear(K, N, device="cuda")
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5)
        lin.bias.copy_(torch.randn(N, device="cuda", generator=g) * 0.1)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    pg = W4A4Linear.from_linear(lin, rank=32, act_sample=x[:256].float(), dtype=torch.bfloat16, backend="sm90", fmt="int4_pg")
    y_serial = pg(x).clone()
    t_serial = time_cuda(lambda: pg(x), warmup=10, iters=iters, graph=True)

    h = M // 2
    x1, x2 = x[:h], x[h:]
    args = pg.op_args(x1.contiguous(), "sm90")
    plan = ops.BoundLinear(args, None)
    q1 = plan.quantize
    # the second half's first pass: a programmatic dependent of the GEMM before it, never waiting for it
    launch = gemm._quant_setup(x2, args[5], ops.lora_down_t(args[6]), "int4_pg", gemm.ACT_STAGES, gemm.ACT_CTAS_PER_SM)
    ks, sig = launch["ks"], launch["sig"]
    q2 = copy.copy(q1)
    rowmax, partial, base, lora_act, codes, codes32 = q1._tensors(x.device, False)
    first = [x2, q1.sm, q1.ldt, codes32, rowmax, partial]
    q2.first = gemm.launchable(("rowmax dependent", *sig), x.device, gemm._quant_compiler(
        lambda: QuantLoraDown(q1.R, gemm.ACT_STAGES, True, ks, mode="pg_rowmax", dependent=True), gemm.QUANT_ARGS, first))
    # the GEMM on nsms CTAs, letting its dependent start
    qd, qs, qg, qb = args[1], args[2], args[3], args[4]
    act = QTensor.trusted(codes, None, "int4_pg", base=base)
    wgt = ops.weights(qd, qs, "int4_pg", qg, qb)
    out_h = torch.empty(h, N, dtype=torch.bfloat16, device="cuda")
    fn, tensors, cls, p, _ = gemm._launch(act, wgt, lora_act, args[7], args[8], args[9], torch.bfloat16, None, out_h)
    config = gemm.tile_choice(gemm.default_config("int4_pg"), p)
    budget = smem.solve(gemm.bind(config, p), k=p.K)
    kern = TriggerPg(budget, p, nsms)
    specs = kern.arguments(p)
    gemm_t = gemm.BoundGemm(gemm.compile_launchable(kern, specs, True), tensors, specs, ())
    print("config", config.tile_m, "ks", ks, flush=True)

    out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    def fwd():
        a1 = q1(x1)
        gemm_t(*a1, out[:h])
        a2 = q2(x2)
        plan.gemm(*a2, out[h:])
        return out
    def fwd_plain():
        a1 = q1(x1)
        plan.gemm(*a1, out[:h])
        a2 = q1(x2)
        plan.gemm(*a2, out[h:])
        return out
    res = dict(M=M, K=K, N=N, nsms=nsms, ks=ks, serial_us=t_serial["median_ms"] * 1e3)
    for name, f in (("overlap", fwd), ("halves", fwd_plain)):
        out.zero_()
        t = time_cuda(f, warmup=10, iters=iters, graph=True)
        y = out.clone()
        res[name + "_us"] = t["median_ms"] * 1e3
        res[name + "_max_diff"] = (y.float() - y_serial.float()).abs().max().item()
        res.setdefault("ys", []).append(y)
    with torch.no_grad():
        r = lin(x.float())
    ys = res.pop("ys")
    res["overlap_vs_halves_equal"] = bool(torch.equal(ys[0], ys[1]))
    res["serial_rel_err"] = ((y_serial.float() - r).norm() / r.norm()).item()
    print(json.dumps(res), flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args(argv)
    rows = [measure(M, K, N, s, a.iters) for M, K, N, s in SHAPES]
    command = f"python tools/overlap_halves.py --out nbs/data/{a.out.name}" + (f" --iters {a.iters}" if a.iters != 30 else "")
    prov = provenance(command, [[M, K, N] for M, K, N, _ in SHAPES], kind="layer_overlap_halves", rank=32, timing="cuda_graph")
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
