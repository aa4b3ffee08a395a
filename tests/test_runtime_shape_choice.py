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
