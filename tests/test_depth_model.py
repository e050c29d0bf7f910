"""The depth model's held stages (chapter 21), its inverse, and the recorded pointer chase it reads."""
import pytest

from w4a4_book.bench import latency


def test_held_stages():
    "A consumer holding h stages occupies each for h K-blocks: h stages never hide a load, and fewer are refused."
    assert latency.depth_model(1.0, 2.0, 2, held=2) == 2.0 and latency.depth_model(1.0, 0.0, 2, held=2) == 1.0
    assert latency.stages_needed(1.0, 2.0, held=2) == 4 and latency.stages_needed(0.5, 1.0, t_bytes=4.0, held=2) == 2
    with pytest.raises(ValueError, match="stages=1"):
        latency.depth_model(1.0, 1.0, 1, held=2)
    with pytest.raises(ValueError, match="held=0"):
        latency.depth_model(1.0, 1.0, 1, held=0)


def test_latency_for_inverts_the_model():
    "Below the plateau, `latency_for` gives back the latency that `depth_model` was given."
    for h in (1, 2):
        assert latency.latency_for(0.5, latency.depth_model(0.5, 0.8, 2, held=h), 2, held=h) == pytest.approx(0.8)


def test_recorded_latency():
    lat = latency.recorded_latency()
    assert set(lat) == {"dram", "l2"} and 0 < lat["l2"] < lat["dram"] < 5e-6
