"tools/ncu_stalls.py: the parser of ncu's CSV details page (the profiling itself needs a GPU and ncu)."
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("ncu_stalls", Path(__file__).resolve().parent.parent / "tools" / "ncu_stalls.py")
ncu_stalls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_stalls)

CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","127.0.0.1","kernel_cutlass_kernel_w4a4_x","1","7","(512, 1, 1)","(132, 1, 1)","0","9.0","SchedulerStats","Issue Slots Busy","%","61.20"
"0","1","python3","127.0.0.1","kernel_cutlass_kernel_w4a4_x","1","7","(512, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","","1,234.5"
"0","1","python3","127.0.0.1","kernel_cutlass_kernel_w4a4_x","1","7","(512, 1, 1)","(132, 1, 1)","0","9.0","SpeedOfLight","Memory Throughput","","n/a"
'''


def test_parse_details_csv():
    metrics, kernel = ncu_stalls.parse(CSV)
    assert kernel == "kernel_cutlass_kernel_w4a4_x"
    assert metrics["SchedulerStats"] == {"Issue Slots Busy (%)": 61.2}
    assert metrics["Command line profiler metrics"]["smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"] == 1234.5
    assert metrics["SpeedOfLight"]["Memory Throughput"] == "n/a"
