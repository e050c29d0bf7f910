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


def test_kloop_timeline_one_stage_exposes_the_load():
    "v1's loop with one stage waits a whole load latency before every K-block; v2's roles likewise, on the decode warps."
    from w4a4_book.kernels.sm90_parts import WarpRoles
    v1 = latency.kloop_timeline(6, 2.0, 0.3, 0.7, 1)
    assert [round(e["end"] - e["start"], 9) for e in v1 if e["kind"] == "wait"] == [2.0] * 6
    v2 = latency.kloop_timeline(6, 2.0, 1.0, 0.5, 1, decode_stages=2, roles=WarpRoles())
    assert [round(e["end"] - e["start"], 9) for e in v2 if e["what"].startswith("main_full")] == [2.0] * 6


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("lat", [0.25, 1.0, 3.0, 7.0])
def test_kloop_timeline_steady_state_is_the_depth_model(stages, lat):
    "In steady state the event model runs at `depth_model`'s rate (h = 1): v1's whole loop, and v2 where the decode is slower."
    from w4a4_book.kernels.sm90_parts import WarpRoles
    v1 = latency.kloop_timeline(1200, lat, 0.4, 0.6, stages)
    assert latency.timeline_period(v1) == pytest.approx(latency.depth_model(1.0, lat, stages), rel=0.01)
    for dstages in (2, 3):
        v2 = latency.kloop_timeline(1200, lat, 1.0, 0.7, stages, decode_stages=dstages, roles=WarpRoles())
        assert latency.timeline_period(v2) == pytest.approx(latency.depth_model(1.0, lat, stages), rel=0.01)
    one = latency.kloop_timeline(1200, lat, 1.0, 0.7, 8, decode_stages=1, roles=WarpRoles())
    assert latency.timeline_period(one) == pytest.approx(1.7)   # one decoded stage: decode and MMA take turns


def test_kloop_timeline_enough_stages_hide_the_load_and_waits_point_back():
    "With enough stages only the first load is waited for; every wait ends when an earlier event ends (or at a load)."
    from w4a4_book.kernels.sm90_parts import WarpRoles
    assert [e["k"] for e in latency.kloop_timeline(20, 1.0, 0.5, 1.0, 3) if e["kind"] == "wait"] == [0]
    ev = latency.kloop_timeline(20, 1.0, 0.5, 1.0, 3, decode_stages=2, roles=WarpRoles())
    ends = {e["end"] for e in ev if e["kind"] in ("work", "load")} | {0.0}
    assert all(any(abs(e["end"] - t) < 1e-12 for t in ends) for e in ev if e["kind"] == "wait")
    assert latency.timeline_period(ev) == pytest.approx(1.0)              # the MMA warps set the pace
    with pytest.raises(ValueError, match="stages=0"):
        latency.kloop_timeline(4, 1.0, 1.0, 1.0, 0)


def test_plot_timeline(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    fig = latency.plot_timeline(latency.kloop_timeline(5, 0.5, 0.2, 1.0, 2), path=tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0 and len(fig.axes[0].get_yticklabels()) == 2


def test_pointer_chase_compiles_from_the_package():
    "The kernel compiles as the package holds it (CuTe DSL re-runs its module's imports; a relative one failed there)."
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    cute.compile(latency.PointerChase(), make_fake_compact_tensor(cutlass.Int32, (1 << 20,)),
                 make_fake_compact_tensor(cutlass.Int32, (1,)), cutlass.Int32(10), make_fake_stream(),
                 options="--gpu-arch sm_90a")
