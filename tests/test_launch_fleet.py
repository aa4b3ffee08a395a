"""Which instances a trace's drop removes (``parcae run --victims``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_parcae.launch.fleet import Fleet
from lightning_parcae.launch.run import _config


def _fleet(victims: str, seed: int = 0, standbys: tuple[int, ...] = ()) -> Fleet:
    instances = {k: SimpleNamespace(member=f"i{k}") for k in range(6)}
    phases = {f"i{k}": ("standby" if k in standbys else "training") for k in range(6)}
    rt = SimpleNamespace(cfg=SimpleNamespace(victims=victims, seed=seed), instances=instances, phases=phases)
    return Fleet(rt)


def test_newest_removes_standbys_then_the_newest_members() -> None:
    assert _fleet("newest", standbys=(1,))._removal_order(list(range(6))) == [1, 5, 4, 3, 2, 0]


@pytest.mark.parametrize("seed", range(5))
def test_random_removes_standbys_first_and_is_reproducible_by_seed(seed: int) -> None:
    a = _fleet("random", seed, standbys=(2,))._removal_order(list(range(6)))
    b = _fleet("random", seed, standbys=(2,))._removal_order(list(range(6)))
    assert a == b and a[0] == 2 and sorted(a) == list(range(6))


def test_random_spreads_losses_over_members_not_by_age() -> None:
    """Over many drops the first member removed is every member about equally often (newest-first always took
    instance 5, so a drop of two never left a stage short and no inter-stage migration ever happened)."""
    fleet = _fleet("random", 7)
    firsts = [fleet._removal_order(list(range(6)))[0] for _ in range(600)]
    counts = [firsts.count(k) for k in range(6)]
    assert min(counts) > 60, counts


def test_victims_option_is_parsed_and_bad_values_rejected(capsys) -> None:
    cfg = _config(["--instances", "2", "--victims", "random", "--seed", "3", "--", "python", "x.py"])
    assert (cfg.victims, cfg.seed) == ("random", 3)
    assert _config(["--instances", "2", "--", "python", "x.py"]).victims == "newest"
    with pytest.raises(SystemExit):
        _config(["--instances", "2", "--victims", "oldest", "--", "python", "x.py"])
    assert "invalid choice: 'oldest'" in capsys.readouterr().err
