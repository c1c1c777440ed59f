"""The registry of correlated-noise strategies: one object per strategy, found by its name.

A strategy is one factorisation ``A = B C`` of the prefix-sum workload, and its class holds
everything dpfy knows about it: the numbers a plan records for it (``keys``), how they are
chosen (:meth:`Strategy.optimised`), the matrix ``C`` and the per-step noise map ``C^{-1}``,
``C u`` without forming ``C``, the single-epoch sensitivity, the total variance of the noise
the model's prefix sums carry, the memory of its noise stream, and the stream itself. A
:class:`~dpfy.correlated.plan.CorrelatedPlan` records only the name and the numbers; the
ledger, the training query, the self-test and the mechanism comparison ask the object
(``plan.rule``) and never branch on the name. Adding a strategy is one module holding its
:class:`Strategy` subclass and its :class:`NoiseStream`, and one :func:`register_strategy`
call (docs/architecture.md, "A correlated-noise strategy").

The streams run on the tensors the training query hands them, through the tensors' own
in-place methods and, for the fused kernels (``addmv``/``addcmul`` with ``out=``), the
functions of the tensor library the query hands in as ``xp`` (torch; the array-namespace
pattern of the Python array API standard): this layer imports no torch, so the ledger can
recompute a plan's sensitivity without it. The NumPy streams the tests compare them with live
in ``tests/correlated_oracles.py``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import numpy as np

from dpfy.correlated.schemas import Schema
from dpfy.correlated.workload import prefix_error_total, toeplitz_inverse_coeffs, toeplitz_lower

#: The numbers a plan records for its strategy: name -> values.
Params = Mapping[str, tuple[float, ...]]
#: A tensor of the training query (a ``torch.Tensor``); typed loosely because this layer
#: imports no torch and touches tensors only through their methods.
Tensor = Any
#: ``add(a, b, w)``: add the noise ``w`` of the values ``a:b`` where the caller wants it.
AddNoise = Callable[[int, int, Tensor], None]


class NoiseStream(abc.ABC):
    """The per-step noise ``(C^{-1} z)_t`` of one strategy over a flat vector of ``size``.

    ``next(z)`` takes the fresh ``z_t`` (already scaled to its std; the caller's buffer, which
    ``refill`` overwrites) and returns ``w_t`` (a tensor the stream owns until the next
    call). The state is ``buf`` (``rows x size``, rows from
    :meth:`Strategy.state_rows`), the step and, for a ring buffer, its ``head``; it holds
    past noise and is as secret as the noise itself.
    """

    #: the stream calls ``add`` itself, chunk by chunk, in the pass that makes ``w_t``
    fuses_add: ClassVar[bool] = False

    def __init__(self, steps: int, size: int, rows: int, like: Tensor) -> None:
        self.steps, self.size, self.step, self.head = int(steps), int(size), 0, 0
        self.w: Tensor = like.new_empty(self.size)
        self.buf: Tensor = like.new_zeros((rows, self.size))

    def draws(self) -> int:
        """Fresh vectors the current step needs (1 unless the strategy says otherwise)."""
        return 1

    def next(
        self, z: Tensor, *, refill: Callable[[], None] | None = None, add: AddNoise | None = None
    ) -> Tensor:
        """``w_t`` from the fresh ``z_t``; advances one step. ``add``: also hand every value
        of ``w_t`` to ``add(a, b, w[a:b])`` (once). ``refill``: overwrite ``z`` with a further
        fresh draw (needed when :meth:`draws` is above 1)."""
        if self.step >= self.steps:
            raise ValueError(
                f"the correlated-noise plan covers steps={self.steps}; step {self.step} "
                "is beyond it (plan a longer run)"
            )
        w = self._next(z, refill, add if self.fuses_add else None)
        if add is not None and not self.fuses_add:
            add(0, self.size, w)
        self.step += 1
        return w

    @abc.abstractmethod
    def _next(self, z: Tensor, refill: Callable[[], None] | None, add: AddNoise | None) -> Tensor:
        """``w_t`` (in ``self.w``), the state advanced; ``add`` is passed only if ``fuses_add``."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "head": self.head, "buf": self.buf.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        buf = state["buf"]
        if tuple(buf.shape) != tuple(self.buf.shape):
            raise ValueError(
                f"noise state must have shape {tuple(self.buf.shape)}, got {tuple(buf.shape)}"
            )
        self.buf.copy_(buf)
        self.step, self.head = int(state["step"]), int(state["head"])


class Strategy(abc.ABC):
    """One correlated-noise strategy with its numbers (an instance is one plan's ``C``).

    A subclass sets ``name`` (ledgers, events and the command line spell it so) and ``keys``
    (the numbers a plan records), builds itself from them (:meth:`from_params`, which
    validates) or from an optimiser (:meth:`optimised`), and answers for ``steps`` steps.
    Contract: ``C^T C >= 0`` entrywise, which makes the cyclic sensitivity the plan computes
    from :meth:`apply` (all-ones patterns) exact (Choquette-Choo et al. 2023, Thm. 2); every
    built-in ``C`` has entries ``>= 0``, and :meth:`from_params` refuses numbers that break
    it (BLT checks its coefficients).
    """

    name: ClassVar[str]
    keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abc.abstractmethod
    def from_params(cls, params: Params, steps: int) -> Strategy:
        """The strategy a plan records (``params`` holds exactly ``keys``, finite floats).

        Raises:
          ValueError: numbers that do not make a valid strategy for ``steps`` steps.
        """

    @classmethod
    @abc.abstractmethod
    def optimised(
        cls, steps: int, schema: Schema, *, band: int, buffers: int, maxiter: int
    ) -> Strategy:
        """The strategy an optimiser chooses for ``steps`` steps under ``schema`` (``band``
        and ``buffers`` size the Toeplitz strategies; the others ignore them)."""

    @abc.abstractmethod
    def params(self) -> dict[str, tuple[float, ...]]:
        """The numbers a plan records (``keys``), as tuples of floats."""

    @property
    def band(self) -> int:
        """Band width or buffer count as the event records it (0: not applicable)."""
        return 0

    @abc.abstractmethod
    def strategy_matrix(self, steps: int) -> np.ndarray:
        """``C`` (dense: tests and small ``T``), ``steps`` columns."""

    @abc.abstractmethod
    def noise_map(self, steps: int) -> np.ndarray:
        """``G`` (``T x rows of C``, ``G C = I``): the per-step noise is ``G z``."""

    @abc.abstractmethod
    def apply(self, u: np.ndarray) -> np.ndarray:
        """``C u`` for ``u`` of ``T`` entries, without forming ``C``."""

    @abc.abstractmethod
    def sensitivity(self, steps: int) -> float:
        """``max_j ||C e_j||`` over the ``steps`` columns: one participation, any step."""

    @abc.abstractmethod
    def prefix_error(self, steps: int) -> float:
        """Total variance of the noise of the ``T`` released prefix sums per unit
        ``sigma^2`` (``||B||_F^2``, ``B = A C^{-1}`` the decoder)."""

    @abc.abstractmethod
    def state_rows(self, steps: int) -> int:
        """Vectors of the parameters' size the noise stream keeps."""

    def largest_fitting(self, rows: int) -> tuple[str, int] | None:
        """The option (name, value) whose stream keeps at most ``rows`` vectors, if an
        option sizes the state (None: it grows with ``T`` only)."""
        return None

    @abc.abstractmethod
    def stream(self, steps: int, size: int, like: Tensor, xp: ModuleType) -> NoiseStream:
        """The noise stream over ``size`` values, on ``like``'s device and dtype; ``xp`` is
        the tensor library (``torch``) whose functions the fused kernels call."""


class ToeplitzStrategy(Strategy):
    """A lower-triangular Toeplitz ``C`` given by its first column (BandMF, BLT)."""

    @abc.abstractmethod
    def first_column(self, steps: int) -> np.ndarray:
        """First column of ``C``, ``steps`` entries."""

    @abc.abstractmethod
    def inverse_column(self, steps: int) -> np.ndarray:
        """First column of ``C^{-1}``, ``steps`` entries."""

    def strategy_matrix(self, steps: int) -> np.ndarray:
        return toeplitz_lower(self.first_column(steps), steps)

    def noise_map(self, steps: int) -> np.ndarray:
        return toeplitz_lower(self.inverse_column(steps), steps)

    def apply(self, u: np.ndarray) -> np.ndarray:
        from scipy.signal import fftconvolve  # a heavy import; most importers never apply

        u = np.asarray(u, dtype=float)
        return np.asarray(fftconvolve(self.first_column(u.size), u)[: u.size])

    def sensitivity(self, steps: int) -> float:
        # column j of a lower-triangular Toeplitz matrix is column 0 cut short
        return float(np.linalg.norm(self.first_column(steps)))

    def prefix_error(self, steps: int) -> float:
        return prefix_error_total(toeplitz_inverse_coeffs(self.first_column(steps), steps))


_STRATEGIES: dict[str, type[Strategy]] = {}
_S = TypeVar("_S", bound=type[Strategy])


def register_strategy(cls: _S, *, replace: bool = False) -> _S:
    """Add a strategy class under ``cls.name``; returns it (usable as a class decorator).

    Raises:
      ValueError: not a :class:`Strategy` subclass, or the name is taken by another class
        and ``replace`` is False (a silently replaced strategy would change what every
        ledger recording that name means).
    """
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(f"cls must be a dpfy.correlated.Strategy subclass, got cls={cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"a strategy class must set name to a string, got name={name!r}")
    current = _STRATEGIES.get(name)
    if current is not None and current is not cls and not replace:
        raise ValueError(
            f"a strategy named {name!r} is already registered ({current.__qualname__}); pass "
            "replace=True to replace it"
        )
    _STRATEGIES[name] = cls
    return cls


def unregister_strategy(name: str) -> type[Strategy]:
    """Remove a strategy from the registry (tests, plug-ins); returns its class."""
    cls = find_strategy(name)
    del _STRATEGIES[cls.name]
    return cls


def find_strategy(name: str) -> type[Strategy]:
    """The class registered under ``name``.

    Raises:
      ValueError: no strategy of that name (the message lists the registered ones).
    """
    cls = _STRATEGIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"strategy must be one of {{{', '.join(_STRATEGIES)}}}, got strategy={name!r}"
        )
    return cls


def strategy_names() -> tuple[str, ...]:
    """Names of the registered strategies, in registration order (read at call time)."""
    return tuple(_STRATEGIES)
