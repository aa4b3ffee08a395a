"""The runtime's throughput model (lightning_parcae.runtime.shape_choice.ShapeChooser.model) as built from what the
strategy profiled."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_parcae.runtime.shape_choice import ShapeChooser


def _runtime(layer_times_s: list[float], batch: int = 48, micro: int = 4) -> SimpleNamespace:
    n = len(layer_times_s)
    strategy = SimpleNamespace(global_batch=batch, layer_names=[str(i) for i in range(n)], layer_times=layer_times_s,
                               optimizer_state_factor=2.0, max_stage_memory_bytes=None, full_stack=None,
                               micro_batches=micro, max_pipeline_stages=None)
    return SimpleNamespace(s=strategy, coord=None, _layer_bytes=lambda: [3e4] * n)


@pytest.mark.parametrize("scale", [1.0, 0.1, 10.0])
def test_profiled_seconds_enter_the_throughput_model_as_milliseconds(scale: float) -> None:
    """Regression: the strategy profiles layer times in *seconds* (time.perf_counter) but the throughput model is
    in milliseconds. The seconds went in as they were, so the profiled compute was ~1/1000 of a measured step; the
    fit explained every step by its fixed overhead, priced 3x2 the same as the measured 2x2 (no data-parallel
    speed-up at all), and a job on 6 instances stayed at 2x2 with two idle instances (emulated GPT, hh_55_65)."""
    times_s = [scale * t for t in [0.012] + [0.05] * 8 + [0.03]]
    model = ShapeChooser(_runtime(times_s)).model()
    assert model is not None
    assert model.prior.layer_ms == pytest.approx([1000.0 * t for t in times_s])
    # a measured 2x2 step: the formula's compute plus a fixed 40 ms
    for _ in range(10):
        model.record(2, 2, model.prior.step_ms(2, 2) + 40.0)
    two, three = model.step_ms(2, 2), model.step_ms(3, 2)
    # 3 pipelines run the compute part 2/3 as long: the fitted 3x2 is faster than the measured 2x2 by that much
    assert three < two, (two, three)
    assert three == pytest.approx(40.0 + model.prior.step_ms(3, 2), rel=0.1)


def _planning_runtime(look_ahead: int, events: list) -> SimpleNamespace:
    times_s = [0.0116] + [0.048] * 8 + [0.03]
    rt = _runtime(times_s)
    rt.s.max_stage_memory_bytes = 2.5e5  # 10 layers x 4e4 B of training memory: P >= 2, as in examples/gpt/spot.yaml
    rt.layout = SimpleNamespace(data_parallel=1, pipeline_stages=2)
    rt.coord = SimpleNamespace(history=lambda: [], append_history=lambda n: None, get=lambda k: None)
    rt.throughput_mode, rt.look_ahead, rt.interval_s = "measured", look_ahead, 2.0
    rt.predictor_name, rt.max_instances, rt.stats, rt.migrations = "persistence", 4, {}, []
    rt.event = lambda name, **kw: events.append((name, kw))
    return rt


@pytest.mark.parametrize("look_ahead, explores", [(12, True), (1, False)])
def test_a_vetoed_unsure_shape_is_explored_if_the_forecast_keeps_the_count(look_ahead: int, explores: bool) -> None:
    """Regression: launched as 1x2 on 3 instances (the launcher's first shape), the optimizer chose 1x3, fitted
    13 % faster; the veto refused the move (an unsure fit must not leave a measured shape), and because the
    exploration was only considered when the optimizer itself kept the shape, the job never tried 1x3 and ran
    1x2 with an idle instance for 15 s (bench_replay lh_80_90, hl_15_25). With the forecast keeping 3 instances
    for 12 intervals the try pays; reactive (look-ahead 1: a 2 s horizon) still never explores."""
    events: list = []
    chooser = ShapeChooser(_planning_runtime(look_ahead, events))
    model = chooser.model()
    assert model is not None and model.limits.min_p == 2
    for _ in range(10):
        model.record(1, 2, 1.1 * model.prior.step_ms(1, 2))
    shape = chooser.choose(3, 3, observe=True)
    names = [e[0] for e in events]
    assert "veto" in names  # the optimizer's 1x3 was refused on the fit alone ...
    if explores:
        assert shape == (1, 3) and "explore" in names  # ... and then tried
    else:
        assert shape == (1, 2) and "explore" not in names
