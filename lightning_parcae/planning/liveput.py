"""Liveput: the throughput a shape can *expect* once possible preemptions are counted.

Problem: when k of N instances are about to be preempted, which ones is unknown. Victims are uniform among the N
instances (idle spares included); a shape (D, P) loses some replicas of some stages, and what the job can do
next -- and what that costs -- depends on which. A throughput-optimal shape with no spare and thin stages can be
a poor bet; a slightly narrower one that survives most victim sets with an intra-stage migration can train more.

Everything here is an exact expectation over victim patterns. The cost of a transition depends on the victims
only through ``victims[s]`` (how many replicas of stage s were hit; spares do not matter beyond their count), and
the number of patterns with given ``victims`` is ``prod_s C(D, v_s) * C(N - D*P, k - sum v)`` out of ``C(N, k)``:

* same-depth transitions cost ``combine(max_s m_s, sum_s a_s)`` of per-stage terms (see
  :class:`~lightning_parcae.planning.costmodel.MigrationCostModel`), so a dynamic program over stages with state
  ``(victims so far, running max, running sum)`` gives the exact expectation in ``O(P * k * D * states)``;
* repartitions are enumerated over all ``victims`` vectors when there are at most ``max_patterns`` of them, and
  otherwise estimated from ``samples`` seeded draws -- :class:`Expectation` then carries the standard error.

:func:`liveput` answers the paper's question (best reachable shape *per scenario*); the optimizer uses
:func:`expected_transition_cost` (the target is chosen before the victims are known, which is what a proactive
plan does).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
from scipy.special import gammaln

from lightning_parcae.planning.costmodel import MigrationCostModel, Shape
from lightning_parcae.errors import ConfigurationError

__all__ = ["Expectation", "expected_transition_cost", "transition_costs", "prepare_transfers", "liveput", "victim_patterns",
           "forget_prices"]

MAX_PATTERNS = 5000
"""Largest number of victim patterns enumerated exactly; beyond it repartition costs are sampled."""


@dataclass(frozen=True)
class Expectation:
    """An expected value with its exactness.

    Attributes:
        mean: The expectation.
        stderr: Standard error of the estimate (0.0 when exact).
        exact: Whether ``mean`` was computed by exhaustive enumeration or an exact recursion.
    """

    mean: float
    stderr: float = 0.0
    exact: bool = True


def _check(n: int, d: int, p: int, n_out: int) -> None:
    if n < 0 or n_out < 0 or n_out > n:
        raise ConfigurationError(f"cannot preempt {n_out} of {n} instances: need 0 <= n_out <= N")
    if d * p > n:
        raise ConfigurationError(f"shape ({d}, {p}) needs {d * p} instances but only {n} are present")


@functools.lru_cache(maxsize=65536)
def _count_patterns(d: int, p: int, k_max: int) -> int:
    # number of vectors (v_0..v_{p-1}), 0 <= v_s <= d, sum <= k_max
    ways = [1] + [0] * k_max
    for _ in range(p):
        new = [0] * (k_max + 1)
        for k, w in enumerate(ways):
            if w:
                for v in range(0, min(d, k_max - k) + 1):
                    new[k + v] += w
        ways = new
    return sum(ways)


def victim_patterns(n: int, d: int, p: int, n_out: int) -> Iterator[Tuple[Tuple[int, ...], float]]:
    """Every victim pattern with its probability.

    Args:
        n: Instances before the preemption.
        d: Replicas per stage.
        p: Stages.
        n_out: Instances preempted (uniformly at random among the ``n``).

    Yields:
        ``(victims, probability)``: ``victims[s]`` replicas of stage s were preempted.
    """
    _check(n, d, p, n_out)
    spares = n - d * p
    total = math.comb(n, n_out)

    def rec(s: int, k: int, weight: int, acc: List[int]) -> Iterator[Tuple[Tuple[int, ...], float]]:
        if s == p:
            rest = n_out - k
            w = weight * math.comb(spares, rest) if 0 <= rest <= spares else 0
            if w:
                yield tuple(acc), w / total
            return
        for v in range(0, min(d, n_out - k) + 1):
            acc.append(v)
            yield from rec(s + 1, k + v, weight * math.comb(d, v), acc)
            acc.pop()

    yield from rec(0, 0, 1, [])


def _same_depth(cm: MigrationCostModel, n: int, d: int, p: int, n_in: int, n_out: int, d2: int) -> float:
    if n_out == 0:  # no victims: one pattern, no recursion needed
        m, a = 0.0, 0.0
        for s in range(p):
            tm, ta = cm.stage_term(d, p, d2, s, 0)
            m, a = max(m, tm), a + ta
        return cm.combine(n, d, p, n_in, 0, d2, m, a)
    spares = n - d * p
    states: Dict[Tuple[int, float, float], int] = {(0, 0.0, 0.0): 1}
    for s in range(p):
        terms = [cm.stage_term(d, p, d2, s, v) for v in range(0, min(d, n_out) + 1)]
        new: Dict[Tuple[int, float, float], int] = {}
        for (k, m, a), w in states.items():
            for v in range(0, min(d, n_out - k) + 1):
                tm, ta = terms[v]
                key = (k + v, max(m, tm), a + ta)
                new[key] = new.get(key, 0) + w * math.comb(d, v)
        states = new
    total = math.comb(n, n_out)
    acc = 0.0
    cache: Dict[Tuple[float, float], float] = {}
    for (k, m, a), w in states.items():
        rest = n_out - k
        if rest < 0 or rest > spares:
            continue
        w *= math.comb(spares, rest)
        if (m, a) not in cache:
            cache[(m, a)] = cm.combine(n, d, p, n_in, n_out, d2, m, a)
        acc += cache[(m, a)] * (w / total)
    return acc


@functools.lru_cache(maxsize=4096)
def _all_patterns(d: int, p: int, n_out: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every victim vector with ``v_s <= d`` and ``sum v <= n_out``, whatever N: ``(patterns, log weight, sum)``.

    The same vectors serve every N (only the spares' share, hence the probabilities, depends on it), so what is
    computed per vector -- a repartition's transfer -- is computed once for all N.
    """
    vmax = min(d, n_out)
    log_c = np.array([math.lgamma(d + 1) - math.lgamma(v + 1) - math.lgamma(d - v + 1) for v in range(vmax + 1)])
    pats = np.zeros((1, 0), dtype=np.int64)
    logw = np.zeros(1)
    ks = np.zeros(1, dtype=np.int64)
    for _ in range(p):
        v = np.arange(vmax + 1)
        new_k = ks[:, None] + v[None, :]
        keep = new_k <= n_out
        rep = np.repeat(np.arange(len(pats)), vmax + 1).reshape(len(pats), vmax + 1)[keep]
        vv = np.broadcast_to(v, new_k.shape)[keep]
        pats = np.concatenate([pats[rep], vv[:, None]], axis=1)
        logw = logw[rep] + log_c[vv]
        ks = new_k[keep]
    return pats, logw, ks


@functools.lru_cache(maxsize=4096)
def _pattern_probs(n: int, d: int, p: int, n_out: int) -> np.ndarray:
    """Probabilities of :func:`_all_patterns` rows on ``n`` instances (0 where the spares cannot take the rest)."""
    _, logw, ks = _all_patterns(d, p, n_out)
    spares = n - d * p
    rest = n_out - ks
    ok = (rest >= 0) & (rest <= spares)
    lg = math.lgamma
    r = np.where(ok, rest, 0)
    log_spare = lg(spares + 1) - gammaln(r + 1) - gammaln(spares - r + 1)
    log_total = lg(n + 1) - lg(n_out + 1) - lg(n - n_out + 1)
    return np.where(ok, np.exp(logw + log_spare - log_total), 0.0)


@functools.lru_cache(maxsize=4096)
def _pattern_arrays(n: int, d: int, p: int, n_out: int) -> Tuple[np.ndarray, np.ndarray]:
    """All victim patterns as a (K, p) array with their probabilities (vectorized :func:`victim_patterns`):
    the rows of :func:`_all_patterns` that the spares can complete, with :func:`_pattern_probs`."""
    pats, _, ks = _all_patterns(d, p, n_out)
    rest = n_out - ks
    ok = (rest >= 0) & (rest <= n - d * p)
    return pats[ok], _pattern_probs(n, d, p, n_out)[ok]


def _sampled_patterns(n: int, d: int, p: int, n_out: int, samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    colors = [d] * p + [n - d * p]
    draws = rng.multivariate_hypergeometric(colors, n_out, size=samples)
    return draws[:, :p]


def expected_transition_cost(
    cm: MigrationCostModel,
    n: int,
    shape: Shape,
    n_in: int,
    n_out: int,
    target: Shape,
    *,
    max_patterns: int = MAX_PATTERNS,
    samples: int = 512,
    seed: int = 0,
) -> Expectation:
    """Expected cost (ms) of moving from ``shape`` on ``n`` instances to ``target`` after ``n_out`` preemptions.

    Args:
        cm: The cost model.
        n: Instances before the interval.
        shape: Current ``(D, P)``; ``(0, 0)`` for a job that has not started yet.
        n_in: Instances arriving during the interval.
        n_out: Instances preempted during the interval (uniformly random among the ``n``).
        target: Next ``(D', P')``.
        max_patterns: Enumerate repartition victim patterns exactly up to this many, sample beyond.
        samples: Number of seeded draws when sampling.
        seed: Seed of the draws.

    Returns:
        The expectation (exact, or with its standard error).
    """
    d, p = shape
    d2, p2 = target
    _check(n, d, p, n_out)
    if d2 < 1 or p2 < 1:
        raise ConfigurationError(f"target shape {target} is invalid: D and P must be >= 1")
    if p == p2 and p > 0:
        return Expectation(_same_depth(cm, n, d, p, n_in, n_out, d2))
    if p == 0 or d == 0:
        return Expectation(cm.repartition_cost(n, 0, 0, n_in, n_out, d2, p2, ()))
    # cost = transfer(victims) + rest(fallback?): only the transfer part depends on the victims, and only
    # through (n, d, p, n_out, p2) -- so its distribution is computed once per key and shared by every d2.
    p_fb, e_tr, (var_t, var_f, cov_tf, count), exact = _repartition_transfer(
        cm, n, d, p, n_out, p2, max_patterns, samples, seed
    )
    mean = e_tr
    rest_fb = rest_ok = 0.0
    if p_fb > 0:
        rest_fb = cm.repartition_rest_ms(n, d, p, n_in, n_out, d2, p2, True)
        mean += p_fb * rest_fb
    if p_fb < 1:
        rest_ok = cm.repartition_rest_ms(n, d, p, n_in, n_out, d2, p2, False)
        mean += (1 - p_fb) * rest_ok
    se = 0.0
    if not exact:
        # per draw: cost = T + rest_ok + (rest_fb - rest_ok) * F, with T the finite transfer and F the fallback
        # indicator; both vary with the draw, so both enter the standard error
        delta = rest_fb - rest_ok if 0 < p_fb < 1 else 0.0
        var = var_t + delta * delta * var_f + 2.0 * delta * cov_tf
        se = math.sqrt(max(var, 0.0) / count)
    return Expectation(mean, se, exact)


_Moments = Tuple[float, float, float, int]
_TransferKey = Tuple[int, int, int, int, int, int, int, int]
# One cache per cost model, dropped with it: keying a global dict by id(cm) would hand a new model, allocated at
# a freed model's address, the old model's results.
_TRANSFER_CACHE: "weakref.WeakKeyDictionary[MigrationCostModel, Dict[_TransferKey, Tuple[float, float, _Moments, bool]]]" = (
    weakref.WeakKeyDictionary()
)
_EXACT_MOMENTS: _Moments = (0.0, 0.0, 0.0, 1)


def forget_prices(cm: MigrationCostModel) -> None:
    """Drop what this module cached for ``cm``: its migration constants changed (see
    :meth:`~lightning_parcae.planning.costmodel.DefaultCostModel.set_constants`)."""
    _TRANSFER_CACHE.pop(cm, None)


def _repartition_transfer(
    cm: MigrationCostModel, n: int, d: int, p: int, n_out: int, p2: int, max_patterns: int, samples: int, seed: int
) -> Tuple[float, float, _Moments, bool]:
    """(P(fallback), E[transfer * 1{no fallback}], sample moments, exact?) of a repartition's transfer part.

    The moments ``(var(T), var(F), cov(T, F), draws)`` of the finite transfer T and the fallback indicator F are
    those of the draws when sampling (zeros when exact); the caller combines them with the d2-dependent rest.
    """
    cache = _TRANSFER_CACHE.setdefault(cm, {})
    # with no victims the transfer does not depend on N: one entry serves every N
    key = (n if n_out else -1, d, p, n_out, p2, max_patterns, samples, seed)
    hit = cache.get(key)
    if hit is not None:
        return hit
    if n_out == 0:
        t = cm.repartition_transfer_ms(p, p2, (d,) * p)
        out = (1.0, 0.0, _EXACT_MOMENTS, True) if math.isinf(t) else (0.0, t, _EXACT_MOMENTS, True)
    else:
        exact = _count_patterns(d, p, n_out) <= max_patterns
        if exact:
            # transfers per victim vector are shared by every N (see _all_patterns); only probabilities differ
            vkey = (-1, d, p, n_out, p2, max_patterns, 0, 0)
            vals = cache.get(vkey)  # type: ignore[assignment]
            if vals is None:
                vals = cm.repartition_transfer_batch(p, p2, d - _all_patterns(d, p, n_out)[0])
                cache[vkey] = vals  # type: ignore[assignment]
            probs = _pattern_probs(n, d, p, n_out)
        else:
            victims = _sampled_patterns(n, d, p, n_out, samples, seed)
            probs = np.full(len(victims), 1.0 / len(victims))
            vals = cm.repartition_transfer_batch(p, p2, d - victims)
        fb = np.isinf(vals)
        finite = np.where(fb, 0.0, vals)
        moments = _EXACT_MOMENTS
        if not exact and len(vals) > 1:
            cov = np.cov(np.stack([finite, fb.astype(float)]), ddof=1)
            moments = (float(cov[0, 0]), float(cov[1, 1]), float(cov[0, 1]), len(vals))
        out = (float(probs[fb].sum()), float((probs * finite).sum()), moments, exact)
    if len(cache) > 100_000:
        cache.clear()
    cache[key] = out
    return out


def prepare_transfers(
    cm: MigrationCostModel, shapes: Sequence[Shape], depths: Sequence[int], max_out: int, *, max_patterns: int = MAX_PATTERNS
) -> int:
    """Tabulate, once per cost model, the victim-pattern transfers of repartitions from ``shapes`` to ``depths``.

    The transfer of a repartition depends on which replicas were preempted but not on N (see
    :func:`_all_patterns`), so it can be computed before the first decision for every current shape, every
    target depth and every number of simultaneous preemptions up to ``max_out``; a later decision only weighs
    the table by N's probabilities. Preemption counts beyond ``max_out`` (or beyond ``max_patterns`` patterns)
    are computed when first needed, as before.

    Args:
        cm: The cost model.
        shapes: Current shapes to prepare from.
        depths: Target pipeline depths.
        max_out: Largest number of simultaneous preemptions to tabulate.
        max_patterns: Exact-enumeration limit (larger pattern sets are left to sampling at decision time).

    Returns:
        The number of (shape, preemptions, depth) entries tabulated.
    """
    done = 0
    for d, p in shapes:
        if d < 1 or p < 1:
            continue
        for k in range(0, max_out + 1):
            if k and _count_patterns(d, p, k) > max_patterns:
                break
            for p2 in depths:
                if p2 != p:
                    _repartition_transfer(cm, d * p + k, d, p, k, p2, max_patterns, 512, 0)
                    done += 1
    return done


def transition_costs(
    cm: MigrationCostModel, n: int, shape: Shape, n_in: int, n_out: int, targets: Sequence[Shape]
) -> np.ndarray:
    """Expected costs (ms) of moving from ``shape`` to each of ``targets`` (vector form for the optimizer).

    The same numbers as :func:`expected_transition_cost` target by target, with the checks and the per-depth
    transfer lookups done once per call instead of once per target (a cold decision prices ~10^4 transitions).
    A ``(0, 0)`` target (a paused job) costs 0.
    """
    d, p = shape
    _check(n, d, p, n_out)
    out = np.zeros(len(targets))
    transfer: Dict[int, Tuple[float, float, _Moments, bool]] = {}
    for i, (d2, p2) in enumerate(targets):
        if d2 == 0 and p2 == 0:
            continue
        if d2 < 1 or p2 < 1:
            raise ConfigurationError(f"target shape {(d2, p2)} is invalid: D and P must be >= 1")
        if p == p2 and p > 0:
            out[i] = _same_depth(cm, n, d, p, n_in, n_out, d2)
        elif p == 0 or d == 0:
            out[i] = cm.repartition_cost(n, 0, 0, n_in, n_out, d2, p2, ())
        else:
            tr = transfer.get(p2)
            if tr is None:
                tr = transfer[p2] = _repartition_transfer(cm, n, d, p, n_out, p2, MAX_PATTERNS, 512, 0)
            p_fb, mean = tr[0], tr[1]
            if p_fb > 0:
                mean += p_fb * cm.repartition_rest_ms(n, d, p, n_in, n_out, d2, p2, True)
            if p_fb < 1:
                mean += (1 - p_fb) * cm.repartition_rest_ms(n, d, p, n_in, n_out, d2, p2, False)
            out[i] = mean
    return out


def _pattern_cost(cm: MigrationCostModel, n: int, d: int, p: int, n_in: int, n_out: int, victims: Sequence[int], target: Shape) -> float:
    d2, p2 = target
    if p2 == p:
        m, a = 0.0, 0.0
        for s, v in enumerate(victims):
            tm, ta = cm.stage_term(d, p, d2, s, v)
            m, a = max(m, tm), a + ta
        return cm.combine(n, d, p, n_in, n_out, d2, m, a)
    return cm.repartition_cost(n, d, p, n_in, n_out, d2, p2, tuple(d - v for v in victims))


def liveput(
    cm: MigrationCostModel,
    n: int,
    shape: Shape,
    n_out: int,
    n_in: int = 0,
    *,
    interval_ms: float = 60_000.0,
    max_patterns: int = MAX_PATTERNS,
    samples: int = 512,
    seed: int = 0,
) -> Expectation:
    """Expected samples/s of ``shape`` over the next interval when ``n_out`` instances are preempted and ``n_in`` arrive.

    For each victim pattern the job takes the best shape reachable on the ``n + n_in - n_out`` instances left,
    paying that migration's cost out of the interval:
    ``E_victims[ max_T thr(T) * max(0, interval - cost(victims -> T)) / interval ]``.

    Args:
        cm: The cost model (its throughput model gives ``thr``).
        n: Instances before the interval.
        shape: Current ``(D, P)`` with ``D*P <= n``.
        n_out: Instances preempted.
        n_in: Instances arriving.
        interval_ms: Interval length.
        max_patterns: Exact enumeration limit (sampled beyond).
        samples: Seeded draws when sampling.
        seed: Seed of the draws.

    Returns:
        The expectation (exact, or with its standard error).
    """
    d, p = shape
    _check(n, d, p, n_out)
    after = n + n_in - n_out
    targets = cm.throughput.candidates(after)
    if not targets:
        return Expectation(0.0)
    thr = np.array([cm.throughput.throughput(*t) for t in targets])

    def best(victims: Sequence[int]) -> float:
        costs = np.array([_pattern_cost(cm, n, d, p, n_in, n_out, victims, t) for t in targets])
        return float(np.max(thr * np.clip(interval_ms - costs, 0.0, None) / interval_ms))

    if _count_patterns(d, p, n_out) <= max_patterns:
        return Expectation(sum(prob * best(v) for v, prob in victim_patterns(n, d, p, n_out)))
    draws = _sampled_patterns(n, d, p, n_out, samples, seed)
    cache: Dict[Tuple[int, ...], float] = {}
    vals = np.empty(len(draws))
    for i, row in enumerate(draws):
        key = tuple(int(v) for v in row)
        if key not in cache:
            cache[key] = best(key)
        vals[i] = cache[key]
    return Expectation(float(vals.mean()), float(vals.std(ddof=1) / math.sqrt(len(vals))), exact=False)
