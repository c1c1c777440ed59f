"""Which one-step PLD each sampled Gaussian event needs (docs/architecture.md, 5.2).

The PLD engine (:mod:`dpfy.accounting.pld`) composes steps; this module says what one step of
each supported sampler is, as a *mechanism key*, and builds the step's pessimistic discrete
PLDs from the Poisson-subsampled Gaussian PLDs of :func:`dpfy.accounting.pld.poisson_gaussian_pmf`
(passed in, so that this module does not import the engine).

Three kinds of step, all with the noise multiplier z relative to the clip norm C:

* ``poisson`` (add_or_remove): Poisson rate q; remove pair P = (1-q) N(0, z^2) + q N(1, z^2),
  Q = N(0, z^2); the add direction swaps them. q = 1 is the plain Gaussian.
* ``wor`` (replace_one; fixed-size batches of B out of N drawn without replacement, q = B/N).
  Swapping one example moves the clipped sum by up to 2C, so the Gaussian alone is
  G_mu with mu = 2/z (Dong, Roth, Su 2022, "Gaussian differential privacy", Thm. 4.2: sampling
  m of n without replacement turns an f-DP mechanism into a C_q(f)-DP one, with
  C_q(f) = min{f_q, f_q^-1}** and f_q = q f + (1 - q) Id). f_q is the trade-off function of the
  Poisson pair at rate q and noise z/2, so C_q(f) is the *symmetrised* pair: its hockey-stick
  curve at epsilon >= 0 is max(delta_remove, delta_add) of the Poisson pair (q, z/2), and at
  epsilon < 0 it follows from symmetry. The max is reached: with every other example's
  gradient equal to the replaced one's, a step is exactly the Poisson remove pair at (q, z/2)
  (and the reverse order exactly the add pair), and an adaptive run may switch between the two
  from step to step (Lebeda, Regehr, Kamath, Steinke 2024, "Avoiding pitfalls for privacy
  accounting of subsampled mechanisms under composition"), so composing the two directions
  separately and taking the maximum would be too optimistic. Discretised: the positive losses
  of a PLD whose curve at epsilon >= 0 is the maximum of the two pessimistic curves (the remove
  PLD's own where its curve is the larger at every grid point, as it nearly always is; the two
  are equal at epsilon = 0, where rounding can put the add curve above), mirrored onto negative
  losses (mass p e^-l at -l) and the rest of the mass is put at loss 0. The pair is
  symmetric, so one composition suffices.
* ``truncated`` (add_or_remove; Poisson rate q, batches longer than B_max cut to a uniformly
  random B_max-subset). Condition on the number K of *other* examples drawn (the same under both
  neighbours) being below B_max or not (revealing this only helps an attacker, so the
  *mixture* of the two branches' pairs, the branch shown, dominates). If K < B_max the step is
  the Poisson step (q, z). If K >= B_max, a random B_max-subset of a random K-subset of the others
  is a uniform B_max-subset of the others whatever K is, so the unit's neighbour without it
  releases R (a uniform B_max-subset), and with it the unit is kept with probability
  q_bar = q E[B_max / (K + 1) | K >= B_max] next to a uniform (B_max - 1)-subset (R', one
  replacement away from R, sensitivity 2C): the pair ((1 - q_bar) R + q_bar R', R), dominated
  in both directions by the Poisson pair (q_bar, z/2) (advanced joint convexity, Balle et al.
  2018). Weight t = P(K >= B_max). The same mixture, with the averaged rate, is the one of
  dp_accounting's truncated subsampled Gaussian. The others number N - 1 or N (the neighbour
  of a dataset of N has N - 1 or N + 1 examples): both cases are covered by one mixture that
  gives weight t(N - 1) to (q_bar_max, z/2), 1 - t(N) to (q, z) and the difference to (q, z/2),
  which dominates both of those pairs. This replaces the coupling bound
  (delta + (1 + e^eps) P(some batch over-full)) when it is tighter.

  dp_accounting 0.6.0's truncated subsampled Gaussian (its docstring points to arXiv
  2508.15089) splits the step the same way, with the same t and q_bar, but its cut branch is
  the *replace-one* subsampled pair, (1 - q_bar) N(0) + q_bar N(-1) against
  (1 - q_bar) N(0) + q_bar N(+1) at noise z/2. That pair dominates ours: here the neighbour
  without the unit releases the plain R, so one side carries no shifted component (joint
  convexity over the coupling of R and R' gives the one-sided Poisson pair in each
  direction, and the direction is the same at every step because the neighbouring pair is
  fixed for the run). dp_accounting counts N - 1 others only; on the stored rows where
  truncation binds, our cover term for N others costs less than the tighter cut pair saves,
  and ours is 0.07 % to 3.4 % below its figure. Where truncation barely binds (t <= 2e-6 per
  step) both are the Poisson step and only the discretisation separates them:
  dp_accounting's default grid 1e-4 errs by about 2.4e-6 relative at 300 steps (q = 0.01,
  z = 1), far below our default relative tolerance. So runs with truncated steps also refine
  the grid down to :data:`TRUNCATED_MAX_INTERVAL` (connect-the-dots errs by about C h^2,
  with about the same C in both codes, measured).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dpfy import events as ev

if TYPE_CHECKING:
    from dpfy.accounting.pld import DiscretePLD


#: Finest-needed loss grid interval for runs with truncated steps (2^-14 ~ 6.1e-5): at most
#: 0.37x the squared-interval error of dp_accounting's default 1e-4 grid, so the figure is
#: never looser than dp_accounting's truncated subsampled Gaussian (module docstring).
TRUNCATED_MAX_INTERVAL = 2.0**-14

#: Below this noise multiplier the discretised loss exp(1/(2 z^2)) leaves float range and the
#: grid degenerates; such events are left to RDP (which works in log space).
MIN_NOISE_MULTIPLIER = 0.05


class Mech(NamedTuple):
    """One kind of step: ``kind`` in {poisson, wor, truncated}, rate q, noise multiplier z;
    for ``truncated`` also the weight t and rate q2 of the cut-batch part (noise z/2) and the
    weight t2 of the part that covers both dataset sizes (rate q, noise z/2)."""

    kind: str
    q: float
    z: float
    t: float = 0.0
    q2: float = 0.0
    t2: float = 0.0

    @property
    def symmetric(self) -> bool:
        """Both directions have the same PLD (plain Gaussian, or the symmetrised WOR pair)."""
        return self.kind == "wor" or (self.kind == "poisson" and self.q == 1.0)

    def components(self) -> tuple[tuple[float, float], ...]:
        """The Poisson (rate, noise multiplier) pairs this step is built from."""
        if self.kind == "poisson":
            return ((self.q, self.z),)
        if self.kind == "wor":
            return ((self.q, self.z / 2.0),)
        return ((self.q, self.z), (self.q2, self.z / 2.0), (self.q, self.z / 2.0))


def truncation_weights(
    sampling_rate: float, dataset_size: int, max_batch_size: int
) -> tuple[float, float, float]:
    """(t_min, t_max, q_bar_max) of the truncated step over N - 1 and N other examples.

    t = P(Binomial(n, q) >= B_max) for n others, and q_bar = q E[B_max / (K + 1) | K >= B_max]
    = (B_max / (n + 1)) P(Binomial(n + 1, q) >= B_max + 1) / t (computed in log space).
    """
    from scipy import stats

    q, b = float(sampling_rate), int(max_batch_size)
    ts, qbars = [], []
    for n in (int(dataset_size) - 1, int(dataset_size)):
        log_t = float(stats.binom.logsf(b - 1, n, q)) if n >= b else -math.inf
        ts.append(math.exp(log_t))
        if math.isfinite(log_t):
            log_num = math.log(b / (n + 1.0)) + float(stats.binom.logsf(b, n + 1, q))
            qbars.append(min(q * b / (b + 1.0), math.exp(log_num - log_t)))
    return min(ts), max(ts), max(qbars, default=0.0)


def max_interval(mechanisms: dict[Mech, int]) -> float:
    """Largest loss grid interval the refinement may stop at for these steps (inf: no cap)."""
    if any(m.kind == "truncated" for m in mechanisms):
        return TRUNCATED_MAX_INTERVAL
    return math.inf


def _leaf(event: ev.Event) -> Mech | None:
    if isinstance(event, ev.Gaussian):
        return Mech("poisson", 1.0, event.noise_multiplier)
    if isinstance(event, ev.PoissonSampled) and isinstance(event.event, ev.Gaussian):
        return Mech("poisson", event.sampling_rate, event.event.noise_multiplier)
    if isinstance(event, ev.FixedSizeSampled) and isinstance(event.event, ev.Gaussian):
        return Mech("wor", event.sample_size / event.dataset_size, event.event.noise_multiplier)
    if isinstance(event, ev.TruncatedPoisson):
        q, z = event.sampling_rate, event.noise_multiplier
        t_min, t_max, q_bar = truncation_weights(q, event.dataset_size, event.max_batch_size)
        if t_max <= 0.0:
            return Mech("poisson", q, z)
        return Mech("truncated", q, z, t_min, q_bar, t_max - t_min)
    return None


def flatten(event: ev.Event, count: int, out: dict[Mech, int]) -> None:
    """Collect {mechanism: count} for a supported event tree (see :func:`unsupported`)."""
    if count == 0:
        return
    if isinstance(event, ev.SelfComposed):
        flatten(event.event, count * event.count, out)
        return
    if isinstance(event, ev.Composed):
        for e in event.events:
            flatten(e, count, out)
        return
    if isinstance(event, ev.NonPrivate):
        return
    key = _leaf(event)
    if key is None:  # pragma: no cover - guarded by unsupported()
        raise ValueError(f"pld cannot account {event!r}")
    n = event.steps if isinstance(event, ev.TruncatedPoisson) else 1
    out[key] = out.get(key, 0) + count * n


def _small_z(z: float) -> str | None:
    if z < MIN_NOISE_MULTIPLIER:
        return (
            f"pld needs noise multipliers >= {MIN_NOISE_MULTIPLIER} (its loss grid overflows "
            f"below), got noise_multiplier={z!r}"
        )
    return None


def _leaf_reason(event: ev.Event, replace_one: bool) -> str | None:
    name = type(event).__name__
    if isinstance(event, ev.Gaussian | ev.PoissonSampled | ev.TruncatedPoisson):
        if replace_one:
            return (
                f"pld cannot account sub-event {name} {event!r} beside FixedSizeSampled steps "
                "(a replace_one event tree): only FixedSizeSampled(Gaussian) steps are modelled "
                "under replace_one"
            )
        if isinstance(event, ev.PoissonSampled) and not isinstance(event.event, ev.Gaussian):
            return (
                f"pld supports PoissonSampled(Gaussian) only, got inner "
                f"{type(event.event).__name__} event {event.event!r}"
            )
        if isinstance(event, ev.PoissonSampled):
            return _small_z(event.event.noise_multiplier)  # type: ignore[attr-defined]
        return _small_z(event.noise_multiplier)
    if isinstance(event, ev.FixedSizeSampled):
        if event.adjacency_relation is not ev.Adjacency.REPLACE_ONE:
            return (
                "pld models FixedSizeSampled under replace_one adjacency only, got "
                f"adjacency={event.adjacency!r}"
            )
        if not isinstance(event.event, ev.Gaussian):
            return (
                f"pld supports FixedSizeSampled(Gaussian) only, got inner "
                f"{type(event.event).__name__} event {event.event!r}"
            )
        return _small_z(event.event.noise_multiplier)
    if isinstance(event, ev.NonPrivate):
        return None
    why = {
        ev.Shuffled: "shuffled batches have no Poisson amplification; no PLD is known",
        ev.Deterministic: "deterministic batches have no Poisson amplification",
        ev.BallsAndBins: "Balls-and-Bins needs its own accountant (random_allocation)",
        ev.TruncatedBallsAndBins: "Balls-and-Bins needs its own accountant (random_allocation)",
        ev.RepeatAndSelect: "repeat-and-select is accounted in RDP (Papernot & Steinke)",
    }.get(type(event), "no PLD is implemented for this event type")
    return f"pld cannot account sub-event {name} {event!r}: {why}"


def unsupported(event: ev.Event) -> str | None:
    """None if the PLD engine can account the whole tree, else why not (naming the sub-event)."""
    replace_one = event.adjacency_relation is ev.Adjacency.REPLACE_ONE

    def walk(e: ev.Event) -> str | None:
        if isinstance(e, ev.SelfComposed):
            return walk(e.event)
        if isinstance(e, ev.Composed):
            for c in e.events:
                reason = walk(c)
                if reason is not None:
                    return reason
            return None
        return _leaf_reason(e, replace_one)

    return walk(event)


# --------------------------------------------------------------------------------------------
# One step's discrete PLDs
# --------------------------------------------------------------------------------------------

PoissonPmf = Callable[..., "dict[str, DiscretePLD]"]


def step_pmfs(mech: Mech, h: float, tail: float, poisson: PoissonPmf) -> dict[str, DiscretePLD]:
    """Pessimistic discrete PLDs of one step of ``mech`` on grid ``h``, per direction.

    ``poisson(q, z, h, tail_mass=...)`` builds the Poisson-subsampled Gaussian PLDs.
    """
    if mech.kind == "poisson":
        return poisson(mech.q, mech.z, h, tail_mass=tail)
    if mech.kind == "wor":
        both = poisson(mech.q, mech.z / 2.0, h, tail_mass=tail)
        sym = symmetrised(both["remove"], both["add"])
        return {"remove": sym, "add": sym}
    main = poisson(mech.q, mech.z, h, tail_mass=tail)
    cut = poisson(mech.q2, mech.z / 2.0, h, tail_mass=tail) if mech.t > 0.0 else main
    cover = poisson(mech.q, mech.z / 2.0, h, tail_mass=tail) if mech.t2 > 0.0 else main
    w = (1.0 - mech.t - mech.t2, mech.t, mech.t2)
    return {
        d: mixture(((w[0], main[d]), (w[1], cut[d]), (w[2], cover[d]))) for d in ("remove", "add")
    }


def _grid_deltas(pld: DiscretePLD, lo: int, hi: int) -> np.ndarray:
    """delta(j h) of ``pld`` for the absolute grid indices j = lo..hi (connect-the-dots curve)."""
    from dpfy.accounting.pld import _discounted_tail_sums

    h, r = pld.interval, pld.pmf
    above = np.concatenate((np.cumsum(r[::-1])[::-1], [0.0]))
    g = np.concatenate((_discounted_tail_sums(r, h), [0.0]))
    d = above - math.exp(-h) * g  # d[i] = delta at loss index offset + i - 1, i = 0..n
    i = np.clip(np.arange(lo, hi + 1) - pld.offset + 1, 0, r.size)
    below = np.arange(lo, hi + 1) < pld.offset - 1  # under the grid: delta is linear in e^eps
    out = d[i] + pld.infinity_mass
    if below.any():
        j = np.arange(lo, hi + 1)[below]
        out[below] = above[0] + pld.infinity_mass - np.exp((j - pld.offset) * h) * g[0]
    return out


def symmetrised(remove: DiscretePLD, add: DiscretePLD) -> DiscretePLD:
    """The symmetric discrete PLD whose curve at epsilon >= 0 is max(``remove``'s, ``add``'s).

    Both inputs are pessimistic (their curves lie above the exact ones), so the pointwise
    maximum lies above the exact max(delta_remove, delta_add) of the module doc. Where
    ``remove``'s curve is the larger at every grid point (the Poisson pair's usual order),
    its positive losses are kept as they are. Otherwise (the two curves are equal at
    epsilon = 0, and discretisation can put ``add``'s a rounding error above there) the
    positive losses are recovered from the maximum's grid values: between grid points a
    discrete PLD's curve is linear in e^epsilon, the maximum of two such curves lies below the
    chord through its grid values, and that chord curve is convex, so it is the curve of a
    distribution (mass at loss j h: e^(j h) times the slope change at e^(j h)).

    Both inputs' masses at +infinity (grid truncation) are kept at +infinity, so the result's
    curve is the maximum of the finite parts' curves plus both truncated masses.

    Raises:
      FloatingPointError: the mass left for loss 0 is negative. The public
        ``epsilon``/``delta`` then fall back to the other methods (``auto``) or say so.
    """
    import dataclasses

    h = remove.interval
    inf = min(1.0, remove.infinity_mass + add.infinity_mass)
    top = max(remove.offset + remove.pmf.size, add.offset + add.pmf.size) - 1
    if top < 1:  # no positive loss on the grid: everything at 0 and +infinity
        pmf = np.array([max(0.0, 1.0 - inf)])
        return dataclasses.replace(remove, offset=0, pmf=pmf, infinity_mass=inf)
    if remove.offset > 0:  # pragma: no cover - the Poisson grids start at or below loss 0
        raise ValueError(f"the remove PLD must start at a loss <= 0, got offset {remove.offset}")
    pos = _positive_masses(remove, add, top)
    top = pos.size
    k = np.arange(1, top + 1)
    neg = pos * np.exp(-k * h)
    zero = 1.0 - inf - float(pos.sum()) - float(neg.sum())
    if zero < -1e-9:
        raise FloatingPointError(f"symmetrised PLD has negative mass {zero:.3g} at loss 0")
    pmf = np.concatenate((neg[::-1], [max(zero, 0.0)], pos))
    return dataclasses.replace(remove, offset=-top, pmf=pmf, infinity_mass=inf)


def _positive_masses(remove: DiscretePLD, add: DiscretePLD, top: int) -> np.ndarray:
    """Masses at losses h, 2h, ... (at most ``top`` of them) of a PLD whose finite curve at
    epsilon >= 0 is the maximum of ``remove``'s and ``add``'s finite curves (grid values,
    chords between)."""
    h = remove.interval
    d_rem = _grid_deltas(remove, 0, top) - remove.infinity_mass
    d_add = _grid_deltas(add, 0, top) - add.infinity_mass
    if not np.any(d_add > d_rem):  # add's curve is 0 above remove's grid too
        return np.asarray(remove.pmf[1 - remove.offset :], dtype=float)
    d = np.maximum(d_rem, d_add)
    x = np.exp(np.arange(top + 1) * h)
    slope = np.concatenate((np.diff(d) / np.diff(x), [0.0]))  # on [x_j, x_j+1]; 0 above top
    pos = x[1:] * np.diff(slope)  # convex chords: >= 0 up to rounding
    # raising a rounding-negative mass to 0 only raises the curve
    return np.asarray(np.maximum(pos, 0.0), dtype=float)


def mixture(parts: tuple[tuple[float, DiscretePLD], ...]) -> DiscretePLD:
    """The PLD of a step that runs part i with probability w_i (the choice revealed).

    Loss distributions mix with the weights; so do the masses at +infinity. All parts must
    share one grid interval.
    """
    import dataclasses

    lo = min(p.offset for _, p in parts)
    hi = max(p.offset + p.pmf.size for _, p in parts)
    pmf = np.zeros(hi - lo)
    inf = 0.0
    for w, p in parts:
        pmf[p.offset - lo : p.offset - lo + p.pmf.size] += w * p.pmf
        inf += w * p.infinity_mass
    return dataclasses.replace(parts[0][1], offset=lo, pmf=pmf, infinity_mass=min(1.0, inf))


def loss_std(mech: Mech, poisson_std: Callable[[float, float], float]) -> float:
    """Smallest rough step-loss standard deviation among the step's Poisson components."""
    return min(poisson_std(q, z) for q, z in mech.components()) if math.isfinite(mech.z) else 1.0
