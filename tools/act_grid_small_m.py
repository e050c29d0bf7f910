"""Time the int8-lane activation side's two passes (int4_pg) at M = 256 and 1024 with the first pass at CTAs per SM 4, 2
and 1 (`gemm.k_splits`: at small M the fewest shares giving four CTAs an SM cut K into one-block shares, whose LoRA
partials move as many bytes as x), ring depths and warpgroups a CTA, as CUDA-graph replays with the copy bandwidth of
the same run; check every point writes the defaults' codes and bases, and save a record (`first_pass_wgs.main`).

    python tools/act_grid_small_m.py --out nbs/data/activation_grid_small_m_h200.json
"""
import sys

import first_pass_wgs

SHAPES = tuple((M, K) for M in (256, 1024) for K in (3840, 10240, 15360))
GRID = tuple((cps, stages, wgs) for cps in (4, 2, 1) for stages, wgs in ((2, 1), (4, 1), (4, 2), (8, 2)))   # first: the defaults

if __name__ == "__main__":
    sys.exit(first_pass_wgs.main(shapes=SHAPES, grid=GRID, script="act_grid_small_m.py", doc=__doc__))
