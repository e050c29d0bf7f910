"""An experiment: the two activation passes of the int8-lane formats run at once. The first (`QuantRowmaxFollow`) is
persistent and takes the (row tile, share of K) items tile by tile; the last share of a tile in sums the tile's
row maxima into bases and its LoRA partials into `lora_act`, and counts the tile final. The second (`RowCodesFollow`)
is launched behind it (programmatic dependent launch) and its warps, taken tile by tile too, each wait for their
tile only: they read the x the first pass has just read, so from L2, not from memory."""
from typing import NamedTuple
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass._mlir.dialects import llvm
import cuda.bindings.driver as cuda
import w4a4_book.kernels.sm90_parts as parts
from w4a4_book.kernels.sm90_quant import (G, VEC, QuantLoads, QuantLoraDown, RowCodes, copy_16b, group_scale, pack_int8,
                                          row_base)


def _asm_void(op, constraints, *xs, loc=None, ip=None):
    llvm.inline_asm(None, [x.ir_value(loc=loc, ip=ip) for x in xs], op, constraints, has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _asm(ty, op, constraints, *xs, loc=None, ip=None):
    return llvm.inline_asm(ty, [x.ir_value(loc=loc, ip=ip) for x in xs], op, constraints, has_side_effects=True,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def fence_gpu(*, loc=None, ip=None):
    "Order this thread's memory operations before and after at GPU scope (`fence.acq_rel.gpu`)."
    _asm_void("fence.acq_rel.gpu;", "", loc=loc, ip=ip)


@dsl_user_op
def arrive_release_gpu(addr, *, loc=None, ip=None):
    "Add 1 to the int32 at global `addr`, a release at GPU scope (`red.release.gpu`)."
    _asm_void("red.release.gpu.global.add.s32 [$0], 1;", "l", cutlass.Int64(addr), loc=loc, ip=ip)


@dsl_user_op
def load_relaxed_gpu(addr, *, loc=None, ip=None):
    "The int32 at global `addr`, read anew on every call at GPU scope (`ld.relaxed.gpu`: from L2; no L1 invalidation)."
    return cutlass.Int32(_asm(T.i32(), "ld.relaxed.gpu.global.s32 $0, [$1];", "=r,l", cutlass.Int64(addr), loc=loc, ip=ip))


@dsl_user_op
def load_f32_gpu(addr, *, loc=None, ip=None):
    "The fp32 at global `addr`, read at GPU scope (`ld.relaxed.gpu`: from L2, never a stale L1 line)."
    return cutlass.Float32(_asm(T.f32(), "ld.relaxed.gpu.global.f32 $0, [$1];", "=f,l", cutlass.Int64(addr), loc=loc, ip=ip))


@dsl_user_op
def load_v4_f32_gpu(addr, *, loc=None, ip=None):
    "The four fp32 at 16-byte aligned global `addr`, read at GPU scope (`ld.relaxed.gpu.v4`)."
    ty = llvm.StructType.get_literal([T.f32()] * 4)
    r = _asm(ty, "ld.relaxed.gpu.global.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l", cutlass.Int64(addr), loc=loc, ip=ip)
    return [cutlass.Float32(llvm.extractvalue(T.f32(), r, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def add_acq_rel_gpu(addr, value, *, loc=None, ip=None):
    "Add `value` to the int32 at global `addr` (`atom.acq_rel.gpu`); returns what it held."
    return cutlass.Int32(_asm(T.i32(), "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;", "=r,l,r", cutlass.Int64(addr),
                              cutlass.Int32(value), loc=loc, ip=ip))


@dsl_user_op
def store_relaxed_gpu(addr, value, *, loc=None, ip=None):
    "Store int32 `value` at global `addr` (`st.relaxed.gpu`)."
    _asm_void("st.relaxed.gpu.global.s32 [$0], $1;", "l,r", cutlass.Int64(addr), cutlass.Int32(value), loc=loc, ip=ip)


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None):
    "Let the warp's scheduler run others for about `ns` nanoseconds (`nanosleep`; a hint)."
    _asm_void(f"nanosleep.u32 {ns};", "", loc=loc, ip=ip)


@cute.jit
def addr_of(t: cute.Tensor, crd):
    "The global address of element `crd` of `t`."
    return t.iterator.toint() + cutlass.Int64(cute.crd2idx(crd, t.layout)) * (t.element_type.width // 8)


@parts.kernel_bundle
class FollowOutputs(NamedTuple):
    """What the first pass writes: each share's row maxima (k_splits, M) and LoRA partials (k_splits, M, R) fp32; from
    them, by the tile's last share in, `base` (M,) and `lora_act` (M, R); counters (M, 2) int32, row 64 t tile t's."""
    rowmax: object; lora: object; base: object; lora_act: object; counters: object


class QuantRowmaxFollow(QuantLoraDown):
    """The first pass, persistent: CTA `b` of `ctas` (the items over `rounds`, rounded up) takes items `b, b + ctas, ...`,
    item `i` share `i % k_splits` of row tile `i // k_splits`, all of its K-blocks through one ring that runs on from item to item. Each item ends with its
    row maxima and LoRA partial stored and counted on the tile's counter; the tile's last item in reads every share's
    (at GPU scope), writes the rows' bases and `lora_act`, and counts once more: `k_splits + 1` means final."""

    def __init__(self, fmt, rank, stages, has_smooth, k_splits, rounds):
        super().__init__(rank, stages, has_smooth, k_splits, mode="pg_rowmax")
        self.pg, self.rounds = fmt == "int4_pg", rounds

    def smooth_staged(self, K: int) -> bool:
        return False                               # shares change from item to item: 1/smooth is read where it lies

    def make_storage(self, dt, x_l, w_l, K: int):
        S = self.stages
        fields = dict(full=cute.struct.MemRange[cutlass.Int64, S], empty=cute.struct.MemRange[cutlass.Int64, S],
                      x=cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(x_l)], 1024],
                      w=cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(w_l)], 1024],
                      flag=cute.struct.MemRange[cutlass.Int32, 4])
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    def m_modes(self) -> tuple:
        return (0, None, None, 1, 1, 0, 0 if self.rank else None, 0)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mRecipSmooth: cute.Tensor, mLdT: cute.Tensor, mRowmax: cute.Tensor,
                 mLora: cute.Tensor, mBase: cute.Tensor, mLoraAct: cute.Tensor, mCounters: cute.Tensor, stream: cuda.CUstream):
        BM, R, S = self.tile_m, self.rank, self.stages
        dt = mX.element_type
        row = utils.LayoutEnum.ROW_MAJOR
        RL = max(R, 16)
        x_l = sm90_utils.make_smem_layout_a(row, (BM, RL, G), dt, S)      # (BM, G, S), 128-byte swizzle
        w_l = sm90_utils.make_smem_layout_b(row, (BM, RL, G), dt, self.w_stages)  # (R, G, S)
        cp = cute.nvgpu.cpasync
        tma_x, gX = cp.make_tiled_tma_atom(cp.CopyBulkTensorTileG2SOp(), mX, cute.slice_(x_l, (None, None, 0)), (BM, G))
        tma_w, gW = cp.make_tiled_tma_atom(cp.CopyBulkTensorTileG2SOp(), mLdT, cute.slice_(w_l, (None, None, 0)), (RL, G))
        mma = sm90_utils.make_trivial_tiled_mma(dt, dt, cute.nvgpu.warpgroup.OperandMajorMode.K,
                                                cute.nvgpu.warpgroup.OperandMajorMode.K, cutlass.Float32,
                                                (1, 1, 1), tiler_mn=(BM, RL))
        self.storage = self.make_storage(dt, x_l, w_l, cute.size(mX, mode=[1]))
        self.tx = (BM + R) * G * dt.width // 8
        items = (cute.size(mX, mode=[0]) + BM - 1) // BM * self.k_splits
        self.kernel(QuantLoads(tma_x, gX, tma_w, gW), mRecipSmooth, FollowOutputs(mRowmax, mLora, mBase, mLoraAct, mCounters),
                    mma, x_l, w_l).launch(grid=((items + self.rounds - 1) // self.rounds, 1, 1), block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, loads, mRecipSmooth, outs, mma: cute.TiledMma, x_l, w_l):
        BM, R, S = self.tile_m, self.rank, self.stages
        tma_x, gX, tma_w, gW = loads
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cute.arch.griddepcontrol_launch_dependents()                # the second pass may launch: it waits tile by tile
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
        st = cutlass.utils.SmemAllocator().allocate(self.storage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.full.data_ptr(), num_stages=S, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=self.tx, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sX = st.x.get_tensor(x_l.outer, swizzle=x_l.inner)          # (BM, G, S)
        rX = cute.make_tensor(st.x.data_ptr(), cute.make_layout((BM, G, S), stride=(G, 1, BM * G)))
        sW = st.w.get_tensor(w_l.outer, swizzle=w_l.inner)          # (R, G, S)
        # (TMA, row tiles, K-blocks)
        tXsX, tXgX = cute.nvgpu.cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                                      cute.group_modes(cute.local_tile(gX, (BM, G), (None, None)), 0, 2))
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                                      cute.group_modes(cute.local_tile(gW, (max(R, 16), G), (0, None)), 0, 2))
        thr = mma.get_slice(tidx % 128)
        tCrX = mma.make_fragment_A(thr.partition_A(sX))              # (MMA, MMA_M, MMA_K, S)
        tCrW = mma.make_fragment_B(thr.partition_B(sW))              # (MMA, MMA_N, MMA_K, S)
        tCcC = thr.partition_C(cute.make_identity_tensor((BM, max(R, 16))))   # (MMA, MMA_M, MMA_N) → (m, r)
        acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
        acc.fill(0.0)
        mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        pipeline_init_wait(cluster_shape_mn=(1, 1))
        tma = (tma_x, tXgX, tXsX, tma_w, tWgW, tWsW)
        self.run_items(st, pipe, tma, rX, mRecipSmooth, outs, mma, (tCrX, tCrW, tCcC, acc), cute.size(gX, mode=[0]),
                       cute.size(gX, mode=[1]) // G // self.k_splits)

    @cute.jit
    def item_block(self, j, k_tiles):
        "The flat index `j` of this CTA's K-blocks as `(row tile, share, K-block)`."
        bid, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        item = bid + (j // k_tiles) * ctas
        share = item % self.k_splits
        return item // self.k_splits, share, share * k_tiles + j % k_tiles

    @cute.jit
    def load_at(self, tma, pipe, prod, k_tiles):
        "Warp 0: TMA the K-block of flat index `prod.count` (x and lora_downᵀ) into stage `prod.index`."
        tma_x, tXgX, tXsX, tma_w, tWgW, tWsW = tma
        pipe.producer_acquire(prod)
        bar = pipe.producer_get_barrier(prod)
        tile, _, kb = self.item_block(prod.count, k_tiles)
        cute.copy(tma_x, tXgX[None, tile, kb], tXsX[None, prod.index], tma_bar_ptr=bar)
        if cutlass.const_expr(self.rank > 0):
            cute.copy(tma_w, tWgW[None, kb], tWsW[None, prod.index], tma_bar_ptr=bar)

    @cute.jit
    def run_items(self, st, pipe, tma, rX, mRecipSmooth, outs, mma, frags, M, k_tiles):
        """This CTA's items, their K-blocks one flat stream through the ring: each K-block's LoRA step on wgmma while
        the CUDA cores take its row maxima; at an item's last K-block, `finish_item`."""
        BM, R, S = self.tile_m, self.rank, self.stages
        P, _, _ = cute.arch.grid_dim()
        tCrX, tCrW, tCcC, acc = frags
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        items = (M + BM - 1) // BM * self.k_splits
        total = cutlass.max(items - bid + P - 1, 0) // P * k_tiles
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, S)
        if warp == 0:
            for _ in cutlass.range(cutlass.min(S, total), unroll=1):
                self.load_at(tma, pipe, prod, k_tiles)
                prod.advance()
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
        m_local, half = tidx // 2, tidx % 2
        rowmax = cutlass.Float32(0.0)
        for j in cutlass.range(total, unroll=1):
            tile, share, kb = self.item_block(j, k_tiles)
            pipe.consumer_wait(cons)
            if cutlass.const_expr(R > 0):
                cute.nvgpu.warpgroup.fence()
                for k in cutlass.range_constexpr(G // 16):                  # (MMA, MMA_M, 16) × (MMA, MMA_N, 16)
                    cute.gemm(mma, acc, tCrX[None, None, k, cons.index], tCrW[None, None, k, cons.index], acc)
                cute.nvgpu.warpgroup.commit_group()
            _, amax = self.load_group(rX, mRecipSmooth, m_local, half, cons.index, kb)
            rowmax = cute.arch.fmax(rowmax, amax)
            if cutlass.const_expr(R > 0):
                cute.nvgpu.warpgroup.wait_group(0)
            pipe.consumer_release(cons)
            cons.advance()
            if warp == 0 and prod.count < total:
                self.load_at(tma, pipe, prod, k_tiles)
                prod.advance()
            if j % k_tiles == k_tiles - 1:
                self.finish_item(st, outs, acc, tCcC, rowmax, tile, share, m_local, half)
                acc.fill(0.0)
                rowmax = cutlass.Float32(0.0)

    @cute.jit
    def finish_item(self, st, outs, acc, tCcC, rowmax, tile, share, m_local, half):
        "The item's row maxima and LoRA partial out, counted in on the tile's counter; the tile's last in finishes it."
        BM, R, ks = self.tile_m, self.rank, self.k_splits
        tidx, _, _ = cute.arch.thread_idx()
        M, row0 = cute.size(outs.rowmax, mode=[1]), tile * BM
        if cutlass.const_expr(R > 0):
            for i in cutlass.range_constexpr(cute.size(acc)):
                mm, r = tCcC[i]
                if row0 + mm < M:
                    outs.lora[share, row0 + mm, r] = acc[i]
        if row0 + m_local < M and half == 0:
            outs.rowmax[share, row0 + m_local] = rowmax                     # the shuffle gave both halves the same max
        cute.arch.barrier()                                                 # every thread's stores, before thread 0's release
        flag = st.flag.get_tensor(cute.make_layout((4,)))
        addr = addr_of(outs.counters, (row0, 0))
        if tidx == 0:
            flag[0] = add_acq_rel_gpu(addr, 1)
        cute.arch.barrier()
        if flag[0] == ks - 1:                                               # uniform per CTA: the tile's last share in
            self.finish_tile(outs, row0, M)
            cute.arch.barrier()
            if tidx == 0:
                arrive_release_gpu(addr)                                    # k_splits + 1: bases and lora_act final

    @cute.jit
    def finish_tile(self, outs, row0, M):
        """The tile's bases (from every share's row maxima) and `lora_act` (every share's partial, added in share order,
        rounded once), the other shares' values read at GPU scope."""
        BM, R, ks = self.tile_m, self.rank, self.k_splits
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < BM and row0 + tidx < M:
            mx = cutlass.Float32(0.0)
            for s in cutlass.range_constexpr(ks):
                mx = cute.arch.fmax(mx, load_f32_gpu(addr_of(outs.rowmax, (s, row0 + tidx))))
            outs.base[row0 + tidx] = row_base(mx, self.pg)
        if cutlass.const_expr(R > 0):
            per_row = R // VEC
            gO = cute.zipped_divide(outs.lora_act, (1, VEC))                # ((1, VEC), (M, R/VEC))
            for it in cutlass.range(tidx, BM * per_row, self.threads, unroll=1):
                mm, c = it // per_row, it % per_row
                if row0 + mm < M:
                    acc8 = cute.make_rmem_tensor((VEC,), cutlass.Float32)
                    acc8.fill(0.0)
                    for s in cutlass.range_constexpr(ks):
                        a = addr_of(outs.lora, (s, row0 + mm, c * VEC))
                        lo, hi = load_v4_f32_gpu(a), load_v4_f32_gpu(a + 16)
                        for e in cutlass.range_constexpr(4):
                            acc8[e] = acc8[e] + lo[e]
                            acc8[4 + e] = acc8[4 + e] + hi[e]
                    out = cute.make_rmem_tensor((VEC,), outs.lora_act.element_type)
                    out.store(acc8.load().to(outs.lora_act.element_type))
                    cute.copy(copy_16b(outs.lora_act.element_type), out, gO[(0, None), (row0 + mm, c)])


class RowCodesFollow(RowCodes):
    """The second pass behind `QuantRowmaxFollow`: code warps taken tile by tile (a tile's 64 rows × `per_row`
    pieces, 16 `per_row` CTAs), each CTA waiting until its tile is final (one thread polls), then `RowCodes.codes`'s
    walk with the base the first pass wrote. Each CTA counts itself out on the tile's second counter; the last out zeroes both."""
    BACKOFF_NS = 1000

    def __init__(self, fmt, has_smooth, k_splits):
        super().__init__(fmt, has_smooth, 0, k_splits)

    def m_modes(self) -> tuple:
        return (0, None, 0, 0, 0)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mRecipSmooth: cute.Tensor, mCodes: cute.Tensor, mBase: cute.Tensor,
                 mCounters: cute.Tensor, stream: cuda.CUstream):
        M = cute.size(mX, mode=[0])
        per_row = self.per_row(M, cute.size(mX, mode=[1]))
        warps = (M + 63) // 64 * 64 * per_row
        self.kernel(mX, mRecipSmooth, mCodes, mBase, mCounters, per_row).launch(
            grid=((warps + 3) // 4, 1, 1), block=[self.threads, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mX, mRecipSmooth, mCodes, mBase, mCounters, per_row):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane, U = tidx % 32, self.unroll
        M, vpr = cute.size(mX, mode=[0]), cute.size(mX, mode=[1]) // VEC
        trips = self.trips(cute.size(mX, mode=[1]))
        w = bidx * (self.threads // 32) + cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tile, i = w // (64 * per_row), w % (64 * per_row)
        row, piece = tile * 64 + i % 64, per_row - 1 - i // 64
        t0, t1 = piece * trips // per_row, (piece + 1) * trips // per_row
        gC = cute.zipped_divide(mCodes, (1, VEC // 4))              # ((1, 2), (M, K/VEC))
        ctile = bidx * (self.threads // 32) // (64 * per_row)        # a CTA's warps are of one tile: 4 | 64 per_row
        addr = addr_of(mCounters, (ctile * 64, 0))
        if tidx == 0:                                                 # one poller a CTA, reading L2 (relaxed), then an acquire fence
            seen = load_relaxed_gpu(addr)
            while seen < self.k_splits + 1:
                nanosleep(self.BACKOFF_NS)
                seen = load_relaxed_gpu(addr)
            fence_gpu()
        cute.arch.barrier()
        base = cutlass.Float32(0.0)
        if row < M:
            base = load_f32_gpu(addr_of(mBase, (row,)))
        cute.arch.barrier()                                           # every warp has read its base
        if tidx == 0:
            done = addr_of(mCounters, (ctile * 64, 1))
            if add_acq_rel_gpu(done, 1) == 16 * per_row - 1:          # the tile's last CTA out
                store_relaxed_gpu(addr, 0)
                store_relaxed_gpu(done, 0)
        if row < M:                                                   # uniform per warp
            xr = self.load_x(mX, row, (t1 - 1) * 32 * U + lane, vpr, 0)
            for k in cutlass.range(t1 - t0, unroll=1):
                col0 = (t1 - 1 - k) * 32 * U + lane
                ahead = self.load_x(mX, row, col0 - 32 * U, vpr, t0 * 32 * U)
                xs, amax = self.smooth(xr, mRecipSmooth, col0, vpr)
                mine = amax[0]
                for u in cutlass.range_constexpr(1, U):
                    if (lane % 8) % U == u:
                        mine = amax[u]
                q_u, r = group_scale(mine, base, self.pg)
                for u in cutlass.range_constexpr(U):
                    src = (lane // 8) * 8 + u
                    q_u_u = cute.arch.shuffle_sync(q_u, src)
                    r_u = cute.arch.shuffle_sync(r, src)
                    col = col0 + u * 32
                    if col < vpr:
                        words = cute.make_rmem_tensor((VEC // 4,), cutlass.Int32)
                        pack_int8(cute.slice_(xs, (u, None)), r_u, q_u_u, words, self.pg)
                        cute.autovec_copy(words, gC[(0, None), (row, col)])
                cute.autovec_copy(ahead, xr)
