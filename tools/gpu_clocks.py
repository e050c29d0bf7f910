"""Sample the GPU's SM clock, power and clock-event reasons (`nvidia-smi`, every 50 ms) while one kernel runs back to
back for a few seconds (CUDA-graph replays), for the int4_pg GEMM and cuBLAS's FP8 GEMM (`torch._scaled_mm`) at
the M = 4352 layers: the clock each one's tensor work gets, and why it gets no more.

    python tools/gpu_clocks.py --out nbs/data/gpu_clocks_h200.json
"""
import subprocess, sys, time

import record_cli

OPTIONS = dict(rank=32, seconds=3)
SHAPES = ((4352, 3072, 10240), (4352, 3840, 15360))   # M, N, K
FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "enforced.power.limit", "temperature.gpu",
          "clocks_event_reasons.active")
# the bits of `clocks_event_reasons.active` (nvidia-smi --help-query-gpu)
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown"}


def sample(seconds: float, run) -> list:
    "`nvidia-smi` samples (one dict of `FIELDS` each) taken while `run()` is called until `seconds` have passed."
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        run()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    return [dict(zip(FIELDS, (v.strip() for v in line.split(",")))) for line in lines if line.count(",") == len(FIELDS) - 1]


def summary(samples: list) -> dict:
    "The busy samples' median clock and power, the clock's maximum and the power limit, and how often each reason held."
    import statistics
    busy = [s for s in samples if not int(s["clocks_event_reasons.active"], 16) & 0x1]
    if not busy:
        raise RuntimeError(f"nvidia-smi gave no sample with the GPU busy ({len(samples)} in all): run for more --seconds")
    med = lambda f: statistics.median(float(s[f]) for s in busy)
    reasons = {name: sum(bool(int(s["clocks_event_reasons.active"], 16) & bit) for s in busy) / len(busy)
               for bit, name in REASONS.items()}
    return dict(samples=len(busy), sm_clock_mhz=med("clocks.sm"), max_sm_clock_mhz=med("clocks.max.sm"),
                power_w=med("power.draw"), power_limit_w=med("enforced.power.limit"), temperature_c=med("temperature.gpu"),
                reason_share=reasons)


def launchers(M, N, K, R) -> dict:
    "`{method: callable}`: the library's int4_pg GEMM (its default tile) and cuBLAS's FP8 GEMM on one workload."
    from w4a4_book import gemm
    from w4a4_book.bench.workloads import make_workload, torch_fp8_gemm
    w = make_workload(M, N, K, R, fmt="int4_pg")
    launch, _ = gemm.gemm_launcher(*w.operands, out_dtype=w.out_dtype)
    return dict(w4a4_pg=launch, torch_fp8_gemm=torch_fp8_gemm(w))


def graph_of(fn, calls: int = 20):
    "A callable that replays a CUDA graph of `calls` calls of `fn` and waits for it."
    import torch
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return lambda: (g.replay(), torch.cuda.synchronize())


def main(argv=None):
    "Measure, print and save the record."
    a = record_cli.parse(__doc__, argv, **OPTIONS)
    from w4a4_book.records import provenance, save_record
    rows = []
    for M, N, K in SHAPES:
        for method, fn in launchers(M, N, K, a.rank).items():
            r = dict(method=method, M=M, N=N, K=K, R=a.rank, **summary(sample(a.seconds, graph_of(fn))))
            print(f"{M}x{N}x{K} {method}: {r['sm_clock_mhz']:.0f} MHz of {r['max_sm_clock_mhz']:.0f}, "
                  f"{r['power_w']:.0f} W of {r['power_limit_w']:.0f}, reasons {r['reason_share']}", flush=True)
            rows.append(r)
    prov = provenance(record_cli.command("gpu_clocks.py", a, **OPTIONS), [list(s) for s in SHAPES], kind="gpu_clocks",
                      rank=a.rank, sampler="nvidia-smi -lms 50", fmt="int4_pg")
    print(f"saved {save_record(a.out, prov, rows)}")


if __name__ == "__main__":
    sys.exit(main())
