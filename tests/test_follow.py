"""The two activation passes at once (`gemm.BoundRowsFollow`, an experiment): the same codes and bases as
`quantize`, `lora_act` to its rounding, on repeated calls and CUDA-graph replays, the counters left at zero."""
import pytest
import torch

from w4a4_book import gemm
from test_quant import check_int8_lanes, int8_lane_case

CASES = [  # M (tails included), K, R, dtype, smooth, shares (None: follow_shares)
    (1, 1024, 32, torch.bfloat16, True, None), (300, 1024, 128, torch.bfloat16, True, 4), (257, 3840, 0, torch.float16, False, None),
    (4352, 3840, 32, torch.bfloat16, True, None), (1000, 1024, 256, torch.bfloat16, True, 8), (513, 15360, 32, torch.bfloat16, True, None),
    (4352, 15360, 32, torch.bfloat16, True, 60), (4352, 10240, 32, torch.bfloat16, True, None), (4352, 3840, 32, torch.bfloat16, True, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_pg", "int8"])
@pytest.mark.parametrize("M, K, R, dt, smooth, shares", CASES)
def test_follow_exact_against_quantize(fmt, M, K, R, dt, smooth, shares):
    x, lam, down = int8_lane_case(M, K, R, dt, smooth, 3)
    bound = gemm.BoundRowsFollow(x, lam, down.T.contiguous() if R else None, fmt=fmt, shares=shares)
    codes, base, lora_act = bound(x)
    check_int8_lanes(codes, base, lora_act, x, lam, down, fmt)
    counters = gemm._follow_counters(x.device, M)
    assert not counters.any()
    again = bound(x)
    assert torch.equal(again[0], codes) and torch.equal(again[1], base) and (R == 0 or torch.equal(again[2], lora_act))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = bound(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed[0], codes) and torch.equal(replayed[1], base) and (R == 0 or torch.equal(replayed[2], lora_act))
    assert not gemm._follow_counters(x.device, M).any()
