"""Hugging Face ``transformers`` models pipeline as they are (issue 22).

Problem they guard: wrapped in an ordinary LightningModule, GPT-2 trained at P = 1 but crashed at P = 2 with a torch
traceback in the layer profile ("Trying to backward through the graph a second time": the KV cache that
``transformers`` creates per forward, kept from the probe, was reused by every timed repetition), and Llama was
refused ("forward did not loop over the block list exactly once") because it loops ``self.layers[:n]``, a slice.
Qwen2 picks each layer's mask (full or sliding window) by its ``enumerate`` index, so a stage that counted its own
blocks from 0 would silently use the wrong masks. Multi-process results are compared with one plain process
(``strategy="auto"``) on the same data; what cannot be cut must be refused with a ModelLayoutError that names the
pattern and the fix.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers (a test extra) is not installed")

import pytorch_lightning as pl  # noqa: E402
from lightning_parcae.errors import ModelLayoutError  # noqa: E402
from lightning_parcae.runtime.partition import profile_layer_times  # noqa: E402
from lightning_parcae.runtime.pipeline import BlockListProxy, StageBoundary, without_caches  # noqa: E402
from lightning_parcae.runtime.stage import cut_stage, locate_layer_stack  # noqa: E402
from lightning_parcae.training.strategy import ParcaeStrategy  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from hf_models_worker import SEQ, VOCAB, HFCausalLM, build_model  # noqa: E402

WORKER = Path(__file__).parent / "hf_models_worker.py"
_REFERENCE: dict[str, tuple[dict, dict]] = {}


def _job(out_dir: Path, family: str, p: int) -> tuple[dict, dict]:
    out = out_dir / f"{family}-{p}.json"
    proc = subprocess.run([sys.executable, str(WORKER), family, str(p), str(out)], capture_output=True, text=True,
                          timeout=500, cwd=out_dir)
    res = json.loads(out.read_text()) if out.exists() else {"error": proc.stderr[-3000:]}
    assert proc.returncode == 0, res
    return res, torch.load(str(out) + ".ckpt", weights_only=True)["state_dict"]


def _reference(tmp_path_factory: pytest.TempPathFactory, family: str) -> tuple[dict, dict]:
    if family not in _REFERENCE:
        _REFERENCE[family] = _job(tmp_path_factory.mktemp(f"hf-{family}-ref"), family, 1)
    return _REFERENCE[family]


def _global_rel(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    num = sum(((got[k].double() - want[k].double()) ** 2).sum() for k in want)
    den = sum((want[k].double() ** 2).sum() for k in want)
    return float((num / den).sqrt())


def _parity(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, family: str, p: int, stack: str) -> None:
    res, got = _job(tmp_path, family, p)
    ref, want = _reference(tmp_path_factory, family)
    assert res["P"] == p and res["stack"] == stack
    assert _global_rel(got, want) < 1e-5
    assert res["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)


_STACKS = {"gpt2": "model.transformer.h", "llama": "model.model.layers", "qwen2": "model.model.layers"}


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
@pytest.mark.parametrize("family", ["gpt2", "llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_hf_model_trains_at_p2_like_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                family: str) -> None:
    _parity(tmp_path, tmp_path_factory, family, 2, _STACKS[family])


@pytest.mark.slow  # ~75 s on 2 cores: four processes
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_model_trains_at_p4_like_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                family: str) -> None:
    _parity(tmp_path, tmp_path_factory, family, 4, _STACKS[family])


# ------------------------------------------------------------------------------------------------ units
def test_layer_stack_of_a_hf_model_is_found_without_a_hint() -> None:
    assert locate_layer_stack(HFCausalLM("gpt2")) == "model.transformer.h"
    assert locate_layer_stack(HFCausalLM("llama")) == "model.model.layers"


def test_a_slice_of_the_block_list_runs_this_stage_and_counts_global_positions() -> None:
    """The second stage of a 4-layer Llama holds layers 2 and 3: ``self.layers[:4]`` and ``enumerate`` see four
    positions (the first two pass their input through), attributes read from a block are the real block's, and
    the received activation enters at layer 2."""
    layers = build_model("llama").model.layers
    proxy = BlockListProxy(cut_stage(layers, ["2", "3"]), layers)
    assert len(proxy) == 4
    entries = proxy[: len(layers)]
    assert len(entries) == 4 and [e.self_attn.layer_idx for e in entries] == [0, 1, 2, 3]
    x, given = torch.randn(2, SEQ, 32), torch.randn(2, SEQ, 32)
    rotary = build_model("llama").model.rotary_emb(x, torch.arange(SEQ)[None])
    proxy.mode, proxy.given = "tail", given
    h = x
    for i, block in enumerate(proxy[:4]):
        h = block(h, position_embeddings=rotary)
    ref = given
    for block in list(layers)[2:]:
        ref = block(ref, position_embeddings=rotary)
    torch.testing.assert_close(h, ref)
    proxy.mode = "given"
    assert [b(x) is given for b in proxy[:4]] == [True]  # the mirror of the last stage: one stand-in


def test_head_stage_stops_at_its_last_block_under_a_slice() -> None:
    layers = build_model("gpt2").transformer.h
    proxy = BlockListProxy(cut_stage(layers, ["0", "1"]), layers)
    proxy.mode = "head"
    ran = []
    with pytest.raises(StageBoundary):
        h = torch.randn(2, SEQ, 32)
        for block in proxy[:4]:
            h = block(h)
            ran.append(block)
    assert len(ran) == 1 and proxy.captured is not None  # block 1 raised after running


def test_an_empty_kv_cache_is_dropped_and_a_prefilled_one_kept() -> None:
    from transformers import DynamicCache

    model = build_model("llama")
    empty = DynamicCache(config=model.config)
    args, kwargs = without_caches((empty, 3), {"cache": empty, "use_cache": True, "mask": None})
    assert args == (None, 3) and kwargs == {"cache": None, "use_cache": False, "mask": None}
    with torch.no_grad():
        full = model(input_ids=torch.randint(0, VOCAB, (1, 4)), use_cache=True).cache
    assert full.get_seq_length() == 4
    assert without_caches((), {"cache": full, "use_cache": True}) == ((), {"cache": full, "use_cache": True})
    assert without_caches((), {"cache": full}, empty_only=False)[1] == {"cache": None}


def test_profile_of_gpt2_blocks_with_the_forwards_cache_does_not_backward_twice() -> None:
    """Regression (issue 22): the probe's DynamicCache (filled by the probed forward) was passed to every timed
    repetition; the second repetition attended over the first's keys and backward ran through a freed graph."""
    from transformers import DynamicCache

    model = build_model("gpt2")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (2, SEQ)), cache=cache, use_cache=True)
    assert cache.get_seq_length() == SEQ
    times = profile_layer_times(model.transformer.h, torch.randn(2, SEQ, 32), repeats=2, args=(cache,),
                                kwargs={"use_cache": True, "position_ids": torch.arange(SEQ)[None]})
    assert len(times) == 4 and all(t > 0 for t in times)


# ------------------------------------------------------------------------------------------------ refused patterns
class _Twice(HFCausalLM):
    """A step that runs the model twice on two views of the batch (each block runs twice per step)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss + self.model(input_ids=ids.flip(1), labels=ids).loss


def _strategy(module: pl.LightningModule) -> ParcaeStrategy:
    """A strategy asking for P = 2 whose module is ``module``, on a stand-in for one process's groups, with a
    sample batch for the probe (no Trainer, no processes)."""
    module.example_input_array = None
    strategy = ParcaeStrategy(pipeline_stages=2)
    strategy._lightning_module = module
    strategy.layout.use_groups(types.SimpleNamespace(  # type: ignore[arg-type]
        world=1, pipeline_stages=1, coords=types.SimpleNamespace(stage=0), pipeline_group=None))
    strategy.parallel_devices = [torch.device("cpu")]
    batch = [(torch.randint(0, VOCAB, (SEQ,)),) for _ in range(2)]
    strategy.profiler._sample_batch = lambda trainer: torch.utils.data.default_collate(batch)  # type: ignore
    return strategy


def _partition_at_p2(module: pl.LightningModule) -> None:
    """Run the partition step alone (see :func:`_strategy`)."""
    _strategy(module).layout.partition_module(types.SimpleNamespace(fit_loop=None, state=None))  # type: ignore


def test_a_step_that_runs_the_blocks_twice_is_refused_naming_the_pattern_and_the_fix() -> None:
    with pytest.raises(ModelLayoutError, match=r"'model\.transformer\.h'.*called a block more than once.*"
                                               r"give each depth its own block.*pipeline_stages=1"):
        _partition_at_p2(_Twice("gpt2"))


def test_a_block_shared_between_depths_is_refused_naming_the_pattern_and_the_fix() -> None:
    module = HFCausalLM("llama")
    module.model.model.layers[1] = module.model.model.layers[0]  # ALBERT-style weight sharing
    with pytest.raises(ModelLayoutError, match="same module at two positions.*give each position its own block"):
        _partition_at_p2(module)


def test_a_loop_over_part_of_the_blocks_is_refused_naming_the_pattern_and_the_fix() -> None:
    module = HFCausalLM("llama")
    module.model.config.num_hidden_layers = 3  # Llama loops self.layers[: config.num_hidden_layers]: one left out
    with pytest.raises(ModelLayoutError, match=r"ran only some of the blocks.*self\.blocks\[a:b\].*loop over all"):
        _partition_at_p2(module)


def test_a_plain_hf_forward_passes_the_probe_and_its_blocks_are_timed(recwarn: pytest.WarningsRecorder) -> None:
    """The same probe accepts the unchanged model (the refusals above are the patterns, not the setup), and the
    profile runs on the sample it kept -- whose arguments include the forward's KV cache."""
    module = HFCausalLM("gpt2")
    strategy = _strategy(module)
    strategy.layout.state.stack_path = "model.transformer.h"
    stack = module.model.transformer.h
    assert strategy.profiler.check_block_list(None, stack) is None
    assert strategy.profiler.block_arity == 0  # transformers 5 blocks return the hidden state itself
    strategy.layout.state.layer_names = ["0", "1", "2", "3"]
    times = strategy.profiler.profile(None, stack)  # type: ignore[arg-type]
    assert len(times) == 4 and all(t > 0 for t in times)
    assert not [w for w in recwarn if "could not time the layers" in str(w.message)]  # measured, not the fallback


# ------------------------------------------------------------------------------------------------ under parcae run
RUN_JOB = Path(__file__).parent / "hf_run_job.py"
_TIED_ORDER = (
    "GPT-2 ties its head to its embedding. A pipeline sums that weight's gradient as (e1 + e2) + (h1 + h2) -- the "
    "first stage's embedding parts, then the last stage's head parts (step_runner._exchange_sum_grads) -- one "
    "process as (h1 + e1) + (h2 + e2): one ulp apart after the first step, which 150 Adam steps at lr 0.01 grow "
    "to ~1.5e-2 (a one-process loop with either order reproduces it to three digits). Any run that spends steps "
    "at P > 1 and at P = 1 ends that far from every static run")


def _parcae_run(run_dir: Path, family: str, instances: int, p: int, steps: int, *job_args: str,
                trace: str | None = None) -> tuple[dict, dict]:
    """``tests/hf_run_job.py FAMILY`` for ``steps`` steps under ``parcae run --instances I --pipeline-stages P``:
    through ``trace`` (time scale 10, 0.1 s slept after each step, a planning interval of 0.5 s), or without one a
    static job that never plans (a reference).

    Returns:
        The run's report.json and its final state dict.
    """
    from lightning_parcae.launch.run import main

    run_dir.mkdir()
    out = run_dir / f"{family}.ckpt"
    launch = ["--instances", str(instances), "--pipeline-stages", str(p), "--run-dir", str(run_dir / "run")]
    pace = ["--step-delay", "0", "--interval-s", "600"]
    if trace is not None:
        (run_dir / "trace.csv").write_text(trace)
        launch += ["--trace", str(run_dir / "trace.csv"), "--time-scale", "10", "--grace", "120"]
        pace = ["--step-delay", "0.1", "--interval-s", "0.5"]
    rc = main([*launch, "--", sys.executable, str(RUN_JOB), family, str(out), "--max-steps", str(steps), *pace,
               *job_args])
    assert rc == 0
    report = json.loads((run_dir / "run" / "report.json").read_text())
    assert report["final_step"] == steps
    return report, torch.load(out, weights_only=True)["state_dict"]


def _shapes(report: dict) -> list[str]:
    """The job's D x P over time as report.json lists them (``"1x4"``): the launch's, then one per migration."""
    return [f"{s['D']}x{s['P']}" for s in report["shapes"]]


@pytest.mark.slow  # ~35 s per family on 2 cores: a 2-instance run through a trace, and a 1-instance reference
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_model_under_parcae_run_repartitions_and_ends_with_the_parameters_of_one_process(
        tmp_path: Path, family: str) -> None:
    """GPT-2 and Llama under ``parcae run``, starting at 1 x 2 through a trace 2 -> 1 -> 2 instances: the job
    changes shape (in place, or by a relaunch when the notice comes during start-up) and ends, after 150 steps,
    with the parameters of one process of the same strategy and M (at P = 2 the pipeline is bit-identical to it;
    plain Lightning differs by ~1e-4 after 150 Adam steps because the loss is averaged over M micro-batches).

    GPT-2 cannot meet the 1e-5 here: the run trains its first steps at 1 x 2, the rest at P = 1, and its tied
    embedding's gradient is summed in another order at P > 1 (see ``_TIED_ORDER``; the P = 4 test below compares it
    with a static pipeline instead). Everything else about its run is checked; the comparison is an xfail that
    names the difference."""
    report, got = _parcae_run(tmp_path / "run", family, 2, 2, 150, trace="0,2\n60000,1\n120000,2\n")
    assert report["migrations"] or report["restarts"], report["shapes"]
    _, want = _parcae_run(tmp_path / "ref", family, 1, 1, 150)
    rel = _global_rel(got, want)
    if family == "gpt2" and rel >= 1e-5:
        pytest.xfail(f"{_TIED_ORDER}: global relative difference {rel:.1e} (shapes {_shapes(report)})")
    assert rel < 1e-5, f"global relative difference {rel:.3e}; shapes {_shapes(report)}"


_STATIC_REFERENCE = {"llama": (1, 1), "gpt2": (2, 2)}
"""Instances and P of the static run each family's P = 4 run is compared with: one process for Llama; for GPT-2 a
fixed 1 x 2 pipeline, whose tied gradient is summed in the order of every P > 1 (``_TIED_ORDER``)."""


@pytest.mark.slow  # ~2.5-3 min per family on 2 cores: a 4-instance run through a trace, and a static reference
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_model_at_p4_under_parcae_run_repartitions_in_place_and_ends_with_the_parameters_of_a_static_run(
        tmp_path: Path, family: str) -> None:
    """A 4-stage pipeline of GPT-2 or Llama (one block a stage, the embedding on the first, the head on the last)
    under ``parcae run --instances 4 --pipeline-stages 4`` through a trace 4 -> 3 -> 4 instances is repartitioned
    in place twice -- 1 x 4 -> 1 x 2 at the notice (the leaver hands its block and the head over), 1 x 2 -> 1 x 4
    when a released standby and a new instance are admitted -- and ends, after 600 steps, with the parameters of
    a static run (``_STATIC_REFERENCE``; Llama: one process).

    B = 2 with M = 2 leaves D = 1 the only split, so every shape is 1 x P, and the blocks are split evenly
    (``--even-split``). With the layer profile instead (the first block's time carries the embedding's, the last
    one's the head's, measured while four processes start on two cores) the leader left 1 x 4 for 1 x 2 at its first
    planning interval in both runs tried, before the trace changed anything. Four equal blocks make 1 x 4 the
    fastest shape on 4 instances and 1 x 2 on 3 (1 x 3's slowest stage holds two blocks, as 1 x 2's, behind a
    longer fill), so the shapes are known in advance.
    """
    report, got = _parcae_run(tmp_path / "run", family, 4, 4, 600, "--batch-size", "2", "--even-split",
                              trace="0,4\n300000,3\n600000,4\n")
    shapes = _shapes(report)
    assert not report["restarts"], (shapes, report["restarts"])
    assert shapes == ["1x4", "1x2", "1x4"], report["migrations"]
    moves = report["migrations"]
    assert [m["kind"] for m in moves] == ["repartition", "repartition"], moves
    assert "preemption notice" in moves[0]["reason"] and len(moves[1]["joiners"]) == 2, moves
    instances, p = _STATIC_REFERENCE[family]
    _, want = _parcae_run(tmp_path / "ref", family, instances, p, 600, "--batch-size", "2", "--even-split")
    rel = _global_rel(got, want)
    assert rel < 1e-5, f"global relative difference {rel:.3e} from a static 1 x {p}; shapes {shapes}"
