"""Measure one dependent load's latency on the current GPU with the pointer chase of `w4a4_book.bench.latency`, and
save it as a record: DRAM (a 1 GiB cycle, far larger than L2) and L2 (an 8 MiB one), each the median of a few launches.

    python tools/latency.py --out nbs/data/latency_h200.json
"""
import argparse, statistics, sys
from pathlib import Path


def main(argv=None):
    "Measure, print and save the latency record."
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=5, help="launches per buffer, the median kept (default 5)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from w4a4_book.bench.latency import CHASE_BYTES, CHASE_HOPS, dram_latency
    from w4a4_book.records import provenance, save_record
    rows = []
    for where, nbytes in (("dram", CHASE_BYTES), ("l2", 8 << 20)):
        runs = [dram_latency(nbytes, CHASE_HOPS) for _ in range(a.repeats)]
        rows.append(dict(where=where, nbytes=nbytes, hops=CHASE_HOPS, latency_s=statistics.median(runs), runs=runs))
        print(f"{where}: {rows[-1]['latency_s'] * 1e9:.0f} ns per dependent load", flush=True)
    rel = a.out.name if a.out.is_absolute() else str(a.out)
    command = f"python tools/latency.py --out nbs/data/{Path(rel).name}" + (f" --repeats {a.repeats}" if a.repeats != 5 else "")
    prov = provenance(command, [[r["nbytes"]] for r in rows], kind="latency")
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
