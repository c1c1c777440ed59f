"""``privacy_engine.accountant``: Opacus' accountant names, answered from dpfy's ledger.

Opacus' accountants keep their own history of (noise multiplier, sample rate, steps). Here
there is no second record: every number comes from the run's ledger, where each release is
written before it happens, so ``accountant.get_epsilon(delta)`` is
``dpfy.accounting.epsilon(ledger, delta, method).epsilon`` by construction.

Opacus' names map to dpfy's accountants as follows (``METHODS``):

* ``"rdp"`` -> dpfy ``rdp``: Renyi DP of the Poisson-subsampled Gaussian (Mironov, Talwar and
  Zhang 2019) converted to (epsilon, delta) as Balle et al. (2020). Opacus optimises over a
  fixed grid of orders, dpfy over finer integer and fractional orders, so dpfy's epsilon is
  equal or slightly smaller (1e-4 to 5e-4 relative on the runs compared in
  ``tests/opacus/test_opacus_tutorials.py``).
* ``"prv"`` (Opacus' default) -> dpfy ``pld``: both compose the privacy-loss distribution
  numerically (Gopi, Lee and Wutschitz 2021; Koskela et al. 2020). Opacus reports the upper
  end of an error band of ``eps_error = 0.01``; dpfy's pessimistic PLD is an upper bound of
  its own, usually up to that 0.01 below Opacus' figure.
* ``"gdp"`` -> dpfy ``pld``. Opacus' ``gdp`` is the central-limit approximation of Bu et al.
  (2020) for Poisson subsampling, an asymptotic estimate that is not an upper bound: on runs
  of 8-32 steps it is about 30 % below the PLD bound (which is within 0.2 % of the true
  epsilon), on 2,000 steps 6 % below. dpfy states no number it cannot prove, so the
  same run is accounted with the PLD bound (a warning says so when the engine is made).
* ``"pld"`` is accepted as itself.

A run whose batches are not Poisson-sampled (``poisson_sampling=False``) is accounted with the
method its sampler's privacy event admits (the honest no-amplification bound for shuffled
batches, ``method="shuffle"``), whatever name was asked: a Poisson accountant on such a run
would overstate the privacy.
"""

from __future__ import annotations

from dpfy import accounting
from dpfy.ledger import Ledger

#: Opacus accountant name -> the dpfy accountant that accounts the run (module docstring).
METHODS: dict[str, str] = {"rdp": "rdp", "prv": "pld", "gdp": "pld", "pld": "pld"}


def method_for(name: str) -> str:
    """The dpfy accountant for Opacus' accountant ``name`` (``METHODS``)."""
    if name not in METHODS:
        allowed = ", ".join(METHODS)
        raise ValueError(f"accountant must be one of {{{allowed}}}, got accountant={name!r}")
    return METHODS[name]


class LedgerAccountant:
    """Opacus' accountant interface over the engine's ledger (module docstring).

    Args:
      name: the Opacus accountant name asked for (``"prv"``, ``"rdp"``, ``"gdp"``) or
        ``"pld"``.

    Attributes:
      requested: the name asked for.
      method: the dpfy accountant that answers (``mechanism()``); ``make_private`` sets it to
        the sampler's own when the batches are not Poisson-sampled.
      ledger: the run's ledger once ``make_private`` has run (None before).
    """

    def __init__(self, name: str) -> None:
        self.method = method_for(name)
        self.requested = name
        self.ledger: Ledger | None = None

    def mechanism(self) -> str:
        """The dpfy accountant that computes every epsilon of this engine."""
        return self.method

    def get_epsilon(self, delta: float) -> float:
        """Epsilon the ledger has spent at ``delta`` (0 before the first release)."""
        if self.ledger is None or not self.ledger.noise_multipliers():
            return 0.0
        return float(accounting.epsilon(self.ledger, delta, self.method).epsilon)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """Opacus' ``[(noise_multiplier, sample_rate, steps), ...]``, read off the ledger (each
        release's noise and its sample's rate; consecutive equal steps merged)."""
        out: list[tuple[float, float, int]] = []
        if self.ledger is None:
            return out
        zs = self.ledger.noise_multipliers()
        for sample in self.ledger.samples:
            z, q = zs.get(sample.sample_id), sample.spec.sampling_rate
            if z is None or q is None:
                continue  # drawn, never released; or not a Poisson sample
            if out and out[-1][:2] == (z, q):
                out[-1] = (z, q, out[-1][2] + 1)
            else:
                out.append((float(z), float(q), 1))
        return out

    def get_privacy_spent(
        self, *, delta: float, alphas: list[float] | None = None
    ) -> tuple[float, float]:
        """Opacus' ``(epsilon, best order)``: with ``rdp``, the RDP curve of :attr:`history`
        over ``alphas`` (default Opacus' grid, so at or above :meth:`get_epsilon`, which uses
        finer orders); otherwise ``(get_epsilon(delta), nan)``."""
        if self.method != "rdp":
            return self.get_epsilon(delta), float("nan")
        from dpfy.opacus._accountants import RDPAccountant

        accountant = RDPAccountant()
        accountant.history = self.history
        return accountant.get_privacy_spent(delta=delta, alphas=alphas)

    def __len__(self) -> int:
        """Logical batches released so far (samples in the ledger)."""
        return 0 if self.ledger is None else len(self.ledger.noise_multipliers())

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Refused: the ledger records every release itself, before it happens."""
        raise NotImplementedError(
            "the accountant reads the run's ledger, where each release is written before it "
            "happens; it is never stepped by hand (a hand-made step would describe a release "
            f"that did not happen: noise_multiplier={noise_multiplier!r}, "
            f"sample_rate={sample_rate!r})"
        )

    def __repr__(self) -> str:
        return f"LedgerAccountant(requested={self.requested!r}, method={self.method!r})"
