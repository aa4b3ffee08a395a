"""Tests of lightning_parcae.signals.corpus: seeded trace families, their interval lengths and the dev/held-out split."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_parcae.signals.corpus import FAMILIES, SPLITS, corpus, generate
from lightning_parcae.errors import ConfigurationError


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("seed", [0, 7, 1000])
def test_generate_is_deterministic_and_within_cap_if_same_seed(family: str, seed: int) -> None:
    a = generate(family, seed, hours=3, cap=16)
    b = generate(family, seed, hours=3, cap=16)
    assert a.as_tuples() == b.as_tuples()
    counts = a.counts()
    assert len(a) == 180 and counts.min() >= 0 and counts.max() <= 16
    assert generate(family, seed + 1, hours=3, cap=16).as_tuples() != a.as_tuples() or family == "calm"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_keeps_end_counts_and_totals_if_binned_at_300s(family: str) -> None:
    """A 300-s trace is the 60-s one binned by five: same count at every 5-minute boundary, same arrivals and
    departures in total (both directions kept inside one interval)."""
    fine = generate(family, 3, interval_s=60, hours=4)
    coarse = generate(family, 3, interval_s=300, hours=4)
    assert len(coarse) * 5 == len(fine)
    assert np.array_equal(coarse.counts(), fine.counts()[4::5])
    assert sum(iv.n_in for iv in coarse) == sum(iv.n_in for iv in fine)
    assert sum(iv.n_out for iv in coarse) == sum(iv.n_out for iv in fine)


def test_families_exercise_what_p3_never_does() -> None:
    """The outage family reaches 0 and recovers; flapping crosses the smallest gpt-1.5b depth (6) both ways."""
    out = generate("outage", 0, hours=6).counts()
    assert out.min() == 0 and out[-1] > 0 or np.any(np.diff((out == 0).astype(int)) == -1)
    flap = generate("flapping", 0, hours=6).counts()
    assert np.any(flap < 6) and np.any(flap >= 6)


def test_corpus_splits_use_disjoint_seeds_and_bundled_traces_only_in_dev() -> None:
    assert not set(SPLITS["dev"]) & set(SPLITS["heldout"])
    dev = corpus("dev")
    held = corpus("heldout")
    assert {c.family for c in dev} == {"p3", "p3-segments", *FAMILIES}
    assert {c.family for c in held} == set(FAMILIES)
    assert not {c.name for c in dev} & {c.name for c in held}
    assert all(c.trace.interval_s == 60.0 for c in dev)
    assert all(c.trace.interval_s == 300.0 and len(c.trace) == 216 for c in corpus("heldout", interval_s=300))


def test_generate_and_corpus_raise_if_unknown_names() -> None:
    with pytest.raises(ConfigurationError, match="outage"):
        generate("tsunami", 0)
    with pytest.raises(ConfigurationError, match="dev, heldout"):
        corpus("test")
    with pytest.raises(ConfigurationError, match="positive"):
        generate("calm", 0, hours=0)
