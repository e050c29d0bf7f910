"""What the register decode costs the int4_pg GEMM: the pure GEMM (no LoRA, no affine, fp16 out, the tile the
library picks) with its decode as shipped (`table`: PRMT lookups, no multiply) and with four other instruction
mixes in its place, each timed against the stock CuTe DSL INT8 GEMM in the same process, in interleaved rounds
(CUDA-graph replays). Only `table` computes the right answer; the others compute wrong results on purpose and
measure instructions, not arithmetic:

- `multiply`: the decode before the lookup tables (a mask, one IMAD or IMAD.HI by u and a sign flip per four values);
- `multiplies_only`: its multiplies alone;
- `no_multiply`: the same sequence with each multiply replaced by a LOP3;
- `loads_only`: the packed words as loaded, no ALU work.

Each variant runs in its own process (the kernel cache off), so that no compiled kernel is shared between them.

    python tools/decode_cost.py --out nbs/data/decode_cost_h200.json
"""
import argparse, json, os, subprocess, sys
from pathlib import Path

SHAPES = ((4352, 3840, 15360), (4352, 3072, 10240), (4352, 3072, 3840))
VARIANTS = ("table", "multiply", "multiplies_only", "no_multiply", "loads_only")
LOW, HIGH, FLIP, EIGHTS = 0x0F0F0F0F, 0xF0F0F0F0, 0x80808080, 0x08080808   # the multiply decode's masks


def patch_decode(variant: str) -> None:
    "Replace `W4A4GemmPg.load_decode` in this process by `variant`'s instruction mix (`table`: leave it)."
    if variant == "table":
        return
    import cutlass, cutlass.cute as cute
    from cutlass.cutlass_dsl import T, dsl_user_op
    from cutlass._mlir.dialects import llvm
    import w4a4_book.kernels.pg_decode as pg_decode
    import w4a4_book.kernels.sm90_pg as pg

    @dsl_user_op
    def mad_hi(a, b, c, *, loc=None, ip=None):
        v = lambda x: cutlass.Uint32(x).ir_value(loc=loc, ip=ip)
        return cutlass.Uint32(llvm.inline_asm(T.i32(), [v(a), v(b), v(c)], "mad.hi.u32 $0, $1, $2, $3;", "=r,r,r,r",
                                              has_side_effects=False, is_align_stack=False,
                                              asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    def word(w, half, u, u28, B):
        mask = cutlass.Uint32(LOW if half == "lo" else HIGH)
        if variant == "loads_only":
            return w
        if variant == "no_multiply":
            return (((w & mask) ^ u) & B) ^ cutlass.Uint32(FLIP)
        if variant == "multiplies_only":
            return w * u + B if half == "lo" else mad_hi(w, u28, B)
        return ((w & mask) * u + B if half == "lo" else mad_hi(w & mask, u28, B)) ^ cutlass.Uint32(FLIP)

    def load_decode(self, dv, frag, stage):
        vec = [cute.make_rmem_tensor((4,), cutlass.Uint32) for _ in range(2)]
        for i in range(2):
            vec[i].store(dv.w[(None, i, stage)].load())
        uw = dv.u[stage]
        f32 = cute.recast_tensor(frag, cutlass.Int32)
        consts = []
        for b in range(4):
            u = (uw >> (8 * b)) & cutlass.Uint32(0xFF)
            consts.append((u, u << 28, cutlass.Uint32(FLIP) - u * cutlass.Uint32(EIGHTS)))
        for r, (i, e, half, b) in pg_decode.DECODE.items():
            f32[r] = cutlass.Int32(word(vec[i][e], half, *consts[b]))

    pg.W4A4GemmPg.load_decode = load_decode


def measure(variant: str, iters: int, rounds: int) -> list:
    "This process: `variant` and the stock GEMM on every shape, the best of `rounds` interleaved medians each."
    import torch
    from w4a4_book import gemm
    from w4a4_book.bench.workloads import make_workload, check_gemm_operands, stock_int8_gemm
    from w4a4_book.bench.timing import time_cuda
    patch_decode(variant)
    rows = []
    for M, N, K in SHAPES:
        w = make_workload(M, N, K, 16, fmt="int4_pg", out_dtype=torch.float16)
        cfg = gemm.tile_choice(gemm.default_config("int4_pg"), check_gemm_operands(w.act, w.wgt, out_dtype=torch.float16))
        launch, _ = gemm.gemm_launcher(w.act, w.wgt, out_dtype=torch.float16, config=cfg)
        fns = {"cute_int8_gemm": stock_int8_gemm(w), variant: launch}
        best = {k: float("inf") for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                best[k] = min(best[k], time_cuda(f, warmup=5, iters=iters, graph=True)["median_ms"])
        flops = 2 * M * N * K
        for k, ms in best.items():
            rows.append(dict(method=k, variant=variant, M=M, N=N, K=K, R=0, median_ms=ms, tflops=flops / ms * 1e-9,
                             of_stock=best["cute_int8_gemm"] / ms, tile_m=cfg.tile_m, timing="graph",
                             correct=(k == "cute_int8_gemm" or variant == "table")))
    return rows


def main(argv=None):
    "Run every variant in its own process, print and save the record."
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", choices=VARIANTS, help="(internal) measure this variant here and print its rows as JSON")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if a.one:
        print("ROWS " + json.dumps(measure(a.one, a.iters, a.rounds)), flush=True)
        return 0
    if a.out is None:
        ap.error("--out is required")
    from w4a4_book.records import provenance, save_record
    rows, env = [], {**os.environ, "W4A4_BOOK_KERNEL_CACHE": "off"}
    for v in VARIANTS:
        r = subprocess.run([sys.executable, __file__, "--one", v, "--iters", str(a.iters), "--rounds", str(a.rounds)],
                           env=env, capture_output=True, text=True)
        line = next((l for l in r.stdout.splitlines() if l.startswith("ROWS ")), None)
        if line is None:
            raise RuntimeError(f"variant {v} failed:\n{r.stderr[-2000:]}")
        rows += json.loads(line[5:])
        for x in rows[-2 * len(SHAPES):]:
            if x["method"] != "cute_int8_gemm":
                print(f"{v:16s} {x['M']}x{x['N']}x{x['K']}: {x['median_ms'] * 1e3:.1f} us, {x['of_stock']:.3f}x stock", flush=True)
    command = f"python tools/decode_cost.py --out nbs/data/{a.out.name}" + (f" --iters {a.iters}" if a.iters != 30 else "") + \
        (f" --rounds {a.rounds}" if a.rounds != 3 else "")
    prov = provenance(shapes=[list(s) for s in SHAPES], command=command,
                      kind="decode_cost", variants=list(VARIANTS))
    save_record(a.out, prov, rows)
    print("saved", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
