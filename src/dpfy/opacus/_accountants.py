"""Opacus' stand-alone accountants (``opacus.accountants``), computed by dpfy's accounting.

Opacus' accountants keep a ``history`` of ``(noise_multiplier, sample_rate, steps)`` that the
user (or its optimizer hook) steps by hand. The classes here keep the same history and answer
every epsilon from the dpfy event it describes, ``Composed(SelfComposed(PoissonSampled(q,
Gaussian(z)), steps), ...)``:

* :class:`RDPAccountant` -> dpfy ``rdp`` (Mironov, Talwar and Zhang 2019; the conversion of
  Balle et al. 2020), over finer orders than Opacus' grid: equal or slightly smaller.
* :class:`PRVAccountant` -> dpfy ``pld`` (Koskela et al. 2020; Gopi, Lee and Wutschitz 2021):
  a pessimistic bound, up to Opacus' ``eps_error`` below Opacus' figure.
* :class:`GaussianAccountant` -> dpfy ``pld`` too: Opacus' ``gdp`` is the central-limit
  estimate of Bu et al. (2020), below the true epsilon, and dpfy states no number it cannot
  prove (``mechanism()`` still says ``"gdp"``, ``answered_by`` says ``"pld"``).

A *training run's* accountant is ``PrivacyEngine.accountant``, which reads the run's ledger
and refuses hand-made steps (:mod:`dpfy.opacus.accountant`). These classes are for what
Opacus users do beside training: plan a run, or re-account a history. ``get_noise_multiplier``
calibrates on the safe side of the target (never above it), as every dpfy calibration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from dpfy import accounting
from dpfy import events as ev
from dpfy.accounting import rdp as _rdp

History = list[tuple[float, float, int]]


class IAccountant:
    """Opacus' accountant interface: a history of Poisson-sampled Gaussian steps.

    Attributes:
      history: ``[(noise_multiplier, sample_rate, steps), ...]``; consecutive steps with the
        same noise multiplier and sample rate are merged, as in Opacus.
    """

    name: ClassVar[str] = ""
    answered_by: ClassVar[str] = ""

    def __init__(self) -> None:
        self.history: History = []

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Add one step of the Poisson-subsampled Gaussian mechanism."""
        z, q = float(noise_multiplier), float(sample_rate)
        if not z >= 0 or math.isinf(z):
            raise ValueError(f"noise_multiplier must be in [0, inf), got noise_multiplier={z!r}")
        if not 0 < q <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got sample_rate={q!r}")
        if self.history and self.history[-1][:2] == (z, q):
            self.history[-1] = (z, q, self.history[-1][2] + 1)
        else:
            self.history.append((z, q, 1))

    def event(self) -> ev.Event:
        """The dpfy event the history describes (what every epsilon here is computed from)."""
        return history_event(self.history)

    def get_epsilon(self, delta: float, **_: Any) -> float:
        """Epsilon of the history at ``delta`` (0 before the first step)."""
        if not self.history:
            return 0.0
        return float(accounting.epsilon(self.event(), delta, self.answered_by).epsilon)

    def __len__(self) -> int:
        return sum(steps for _, _, steps in self.history)

    @classmethod
    def mechanism(cls) -> str:
        return cls.name

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """Opacus' hook that steps the accountant at each optimizer step."""

        def hook(optimizer: Any) -> None:
            self.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=sample_rate)

        return hook

    def state_dict(self, destination: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {} if destination is None else destination
        out["history"] = list(self.history)
        out["mechanism"] = self.name
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [(float(z), float(q), int(s)) for z, q, s in state_dict["history"]]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={len(self)}, answered_by={self.answered_by!r})"


class RDPAccountant(IAccountant):
    """Opacus' ``RDPAccountant``, answered by dpfy's RDP accountant (module docstring)."""

    name = "rdp"
    answered_by = "rdp"
    DEFAULT_ALPHAS: ClassVar[list[float]] = [1 + x / 10.0 for x in range(1, 100)] + list(
        range(12, 64)
    )

    def get_privacy_spent(
        self, *, delta: float, alphas: Sequence[float] | None = None
    ) -> tuple[float, float]:
        """``(epsilon, best order)`` over ``alphas`` (default: Opacus' grid) at ``delta``."""
        if not self.history:
            return 0.0, math.nan
        orders = self.DEFAULT_ALPHAS if alphas is None else alphas
        curve = sum(
            compute_rdp(q=q, noise_multiplier=z, steps=s, orders=orders)
            for z, q, s in self.history
        )
        return get_privacy_spent(orders=orders, rdp=curve, delta=delta)

    def get_epsilon(
        self, delta: float, alphas: Sequence[float] | None = None, **_: Any
    ) -> float:
        if alphas is None:
            return super().get_epsilon(delta)
        return self.get_privacy_spent(delta=delta, alphas=alphas)[0]


class PRVAccountant(IAccountant):
    """Opacus' ``PRVAccountant``, answered by dpfy's PLD bound (module docstring); Opacus'
    ``eps_error`` and ``delta_error`` are accepted (dpfy's bound has no error band)."""

    name = "prv"
    answered_by = "pld"


class GaussianAccountant(IAccountant):
    """Opacus' ``gdp`` accountant name, answered by dpfy's PLD upper bound (module
    docstring: the central-limit estimate is not a bound)."""

    name = "gdp"
    answered_by = "pld"


_REGISTRY: dict[str, type[IAccountant]] = {
    "rdp": RDPAccountant, "prv": PRVAccountant, "gdp": GaussianAccountant,
}


def register_accountant(mechanism: str, accountant: type[IAccountant], force: bool = False) -> None:
    """Register an accountant class under ``mechanism`` (a taken name only with ``force``)."""
    if mechanism in _REGISTRY and not force:
        raise ValueError(
            f"mechanism must be a new accountant name (or pass force=True), got "
            f"mechanism={mechanism!r}, taken by {_REGISTRY[mechanism].__name__}"
        )
    _REGISTRY[mechanism] = accountant


def create_accountant(mechanism: str) -> IAccountant:
    """A new accountant registered under ``mechanism`` (``"rdp"``, ``"prv"``, ``"gdp"``)."""
    if mechanism not in _REGISTRY:
        allowed = ", ".join(_REGISTRY)
        raise ValueError(f"mechanism must be one of {{{allowed}}}, got mechanism={mechanism!r}")
    return _REGISTRY[mechanism]()


def history_event(history: History) -> ev.Event:
    """``Composed`` of one ``SelfComposed(PoissonSampled(q, Gaussian(z)), steps)`` per entry."""
    parts = [ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(z)), s) for z, q, s in history]
    return parts[0] if len(parts) == 1 else ev.Composed(tuple(parts))


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: int | None = None,
    steps: int | None = None,
    accountant: str = "rdp",
    epsilon_tolerance: float = 0.01,
    **_: Any,
) -> float:
    """The smallest noise multiplier whose ``steps`` (or ``epochs / sample_rate``) Poisson
    steps stay within ``(target_epsilon, target_delta)``, on the safe side of the target
    (``epsilon_tolerance`` is accepted; dpfy never returns a z whose epsilon exceeds it)."""
    if steps is None:
        if epochs is None:
            raise ValueError("epochs or steps must be given, got epochs=None and steps=None")
        steps = int(epochs / sample_rate)
    method = _REGISTRY[accountant].answered_by if accountant in _REGISTRY else accountant
    n = int(steps)
    return float(
        accounting.calibrate_noise_multiplier(
            lambda z: ev.SelfComposed(ev.PoissonSampled(sample_rate, ev.Gaussian(z)), n),
            target_epsilon, target_delta, method,
        )
    )


def compute_rdp(
    *, q: float, noise_multiplier: float, steps: int, orders: Sequence[float] | float
) -> np.ndarray:
    """RDP of ``steps`` Poisson-subsampled Gaussian steps at ``orders`` (dpfy's
    :func:`dpfy.accounting.rdp.rdp_poisson_gaussian`, times ``steps``)."""
    return np.asarray(_rdp.rdp_poisson_gaussian(q, noise_multiplier, orders)) * steps


def get_privacy_spent(
    *, orders: Sequence[float] | float, rdp: Any, delta: float
) -> tuple[float, float]:
    """``(epsilon, best order)`` of an RDP curve at ``delta`` (Balle et al. 2020, Prop. 12;
    dpfy's :func:`dpfy.accounting.rdp.epsilon_from_rdp`)."""
    eps, order = _rdp.epsilon_from_rdp(np.atleast_1d(rdp), np.atleast_1d(orders), delta)
    return float(eps), float(order)
