"""Where a tile's time goes in the int4_pg GEMM: the library's kernel with clock reads around each tile's K-loop and
epilogue (thread 0 of each MMA warpgroup), written into the stream-K workspace, on the M = 4352 layers. One launch
per shape after a warm-up, outside any graph; the clock reads cost a few instructions a tile, so the launch is timed
beside the library's kernel in the same run to show it is the same kernel. Per tile and warpgroup: the K-loop's
cycles, the epilogue's (in three parts: the vectors' staging, the scale and LoRA, the store), and the gap to the next
tile's K-loop; per CTA: when its first K-loop started and its last
epilogue ended, against the launch's first and last (`%globaltimer`, ns).

    python tools/tile_clock.py --out nbs/data/tile_clock_h200.json
"""
import sys

import record_cli

OPTIONS = dict(rank=32, iters=30)
SHAPES = ((4352, 3072, 3840), (4352, 3072, 10240), (4352, 3840, 15360), (4352, 15360, 3840))   # M, N, K
# per tile and warpgroup: the CTA; the clock at K-loop start, at its end, after the vectors' staging, at the store's
# start and at the epilogue's end; the globaltimer at the first and the last
WORDS = 8


def clock_kernel_class():
    "The library's int4_pg kernel class with the clock reads (built on first use: it imports CuTe DSL)."
    import cutlass
    import cutlass.cute as cute
    from cutlass.cutlass_dsl import T, dsl_user_op
    from cutlass._mlir.dialects import llvm
    from w4a4_book.kernels import pg_decode, pg_variants, sm90_pg

    @dsl_user_op
    def special(reg, *, loc=None, ip=None):
        "A 32-bit special register (`%clock`, `%globaltimer_lo`), read where it stands (volatile)."
        return cutlass.Int32(llvm.inline_asm(T.i32(), [], f"mov.u32 $0, %{reg};", "=r", has_side_effects=True,
                                             is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    class ClockGemm(sm90_pg.W4A4GemmPg):
        "`W4A4GemmPg` with a tile's clock reads in the stream-K workspace (`pg_sk_arguments`)."
        arguments = staticmethod(pg_variants.pg_sk_arguments)
        tensors = staticmethod(pg_variants.pg_sk_tensors)

        def unit_kloop(self, kl, states, kt, after_first=None):
            self._marks = [special("clock"), special("globaltimer_lo")]
            out = super().unit_kloop(kl, states, kt, after_first)
            self._marks.append(special("clock"))
            return out

        def epi_reads(self, cta, pre, t, wgi, m, n):
            out = super().epi_reads(cta, pre, t, wgi, m, n)
            self._marks.append(special("clock"))
            return out

        def finish(self, reads, views, accf, tCcC, out, e):
            if e == 0:                                  # the tile's first sub-tile: the affine and the stores begin
                self._marks.append(special("clock"))
            super().finish(reads, views, accf, tCcC, out, e)

        @cute.jit
        def unit_end(self, cta, thr, lcons, pre, m, n, role, held=None):
            lcons = super().unit_end(cta, thr, lcons, pre, m, n, role, held)
            c2, g2 = special("clock"), special("globaltimer_lo")
            t, wgi, vecs = thr.t, thr.wgi, cta.vecs
            c0, g0, c1, ca, cb = self._marks
            w = ((m * (self.problem.N // pg_decode.TILE_N) + n) * 2 + wgi) * WORDS
            if t == 0:
                vecs.partials[w] = cta.cluster_id
                vecs.partials[w + 1] = c0
                vecs.partials[w + 2] = c1
                vecs.partials[w + 3] = ca
                vecs.partials[w + 4] = cb
                vecs.partials[w + 5] = c2
                vecs.partials[w + 6] = g0
                vecs.partials[w + 7] = g2
            return lcons

    return ClockGemm


def tile_rows(words, K: int, bk: int) -> dict:
    "The per-tile quantities of one launch's words (int64 numpy `(tiles·2, WORDS)`), summarised."
    import numpy as np
    cta, c0, c1, ca, cb, c2, g0, g2 = (words[:, j] for j in range(WORDS))
    kloop, epi = (c1 - c0) % 2 ** 32, (c2 - c1) % 2 ** 32
    vectors, scale_lora, store = (ca - c1) % 2 ** 32, (cb - ca) % 2 ** 32, (c2 - cb) % 2 ** 32
    who = cta * 2 + np.arange(len(words)) % 2          # (CTA, warpgroup): row 2·tile + warpgroup
    order = np.lexsort((c0, who))
    same = who[order][1:] == who[order][:-1]
    gaps = ((c0[order][1:] - c2[order][:-1]) % 2 ** 32)[same]
    ns = lambda x: (x - g0.min()) % 2 ** 32
    first = [ns(g0[cta == c]).min() for c in np.unique(cta)]
    last = [ns(g2[cta == c]).max() for c in np.unique(cta)]
    mhz = float(np.median((c2 - c0) % 2 ** 32 / np.maximum((g2 - g0) % 2 ** 32, 1) * 1e3))
    q = lambda x: dict(median=float(np.median(x)), p10=float(np.percentile(x, 10)), p90=float(np.percentile(x, 90)))
    return dict(kloop_cycles=q(kloop), kloop_cycles_per_block=q(kloop / (K // bk)), epilogue_cycles=q(epi),
                vectors_cycles=q(vectors), scale_lora_cycles=q(scale_lora), store_cycles=q(store),
                gap_cycles=q(gaps) if len(gaps) else None, first_start_ns=q(first), last_end_ns=q(last),
                launch_ns=float(max(last)), clock_mhz=mhz, tiles=int(len(words) // 2))


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    import torch
    from w4a4_book import gemm, smem
    from w4a4_book.bench.timing import time_cuda
    from w4a4_book.bench.workloads import make_workload
    from w4a4_book.kernels import pg_decode, pg_variants
    from w4a4_book.records import provenance, save_record
    Clock, rows = clock_kernel_class(), []
    R = a.rank
    for M, N, K in SHAPES:
        w = make_workload(M, N, K, R, fmt="int4_pg")
        lib_launch, lib_out = gemm.gemm_launcher(*w.operands, out_dtype=w.out_dtype)
        _, tensors, _, p, _ = gemm._launch(*w.operands, w.out_dtype, None, None)
        config = gemm.tile_choice(gemm.default_config("int4_pg"), p)
        dev = tensors[0].device
        kern = Clock(smem.solve(gemm.bind(config, p), k=K), p, gemm.sm_count(dev.index))
        fn = gemm.launchable(("tile_clock", config, p.signature(False)), dev, lambda: (kern, pg_variants.pg_sk_arguments(p), True))
        ts = pg_variants.pg_sk_tensors(p, *w.operands, torch.empty_like(lib_out))
        launch = lambda: fn(*ts)
        lib_launch(), launch()
        torch.cuda.synchronize()
        equal = bool(torch.equal(ts[9], lib_out))
        times = {name: time_cuda(f, warmup=10, iters=a.iters, graph=True)["median_ms"] for name, f in
                 (("library", lib_launch), ("clocked", launch))}
        ts[10].zero_()
        launch()
        torch.cuda.synchronize()
        tiles = -(-M // config.tile_m) * (N // pg_decode.TILE_N)
        words = ts[10][:tiles * 2 * WORDS].view(tiles * 2, WORDS).cpu().numpy().astype("int64") % 2 ** 32
        s = tile_rows(words, K, config.tile_k)
        rows.append(dict(M=M, N=N, K=K, R=R, config=repr(config), equals_library=equal,
                         library_ms=times["library"], clocked_ms=times["clocked"], **s))
        print(f"{M}x{N}x{K} R {R} tile_m {config.tile_m}: library {times['library'] * 1e3:.1f} us, clocked "
              f"{times['clocked'] * 1e3:.1f} us, equal {equal}; {s['tiles']} tiles at {s['clock_mhz']:.0f} MHz: K-loop "
              f"{s['kloop_cycles']['median']:.0f} cycles ({s['kloop_cycles_per_block']['median']:.0f} a block), epilogue "
              f"{s['epilogue_cycles']['median']:.0f} (p90 {s['epilogue_cycles']['p90']:.0f}: vectors "
              f"{s['vectors_cycles']['median']:.0f}, scale and LoRA {s['scale_lora_cycles']['median']:.0f}, store "
              f"{s['store_cycles']['median']:.0f}), gap "
              f"{(s['gap_cycles'] or {}).get('median', float('nan')):.0f}; CTA starts p90 {s['first_start_ns']['p90']:.0f} ns, "
              f"ends p10/median {s['last_end_ns']['p10']:.0f}/{s['last_end_ns']['median']:.0f} of {s['launch_ns']:.0f} ns", flush=True)
    command = record_cli.command("tile_clock.py", a, **OPTIONS)
    prov = provenance(command, [list(s) for s in SHAPES], kind="gemm_tile_clock", rank=a.rank, fmt="int4_pg")
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
