"""User-level DP-SGD: the unit of privacy is a user (or any group: a movie, a patient).

Example-level DP-SGD protects one row; a user who wrote many rows is protected only through
group privacy. User-level DP-SGD (McMahan et al. 2018, "Learning differentially private
recurrent language models"; Levy et al. 2021, "Learning with user-level privacy") makes the
whole of one user's data the unit:

1. **Grouping** (:func:`group_by_user`): every example carries an integer user id. Users are
   numbered 0..U-1 (in increasing id order) and each user is laid out as ``cap`` consecutive
   row slots: its examples, then padding slots (weight 0). A user with more than ``cap``
   examples keeps a uniformly random subset of ``cap`` of them, drawn once before training
   (secure randomness by default) and recorded in the ledger (count, digest, randomness); the
   dropped examples are never read.
2. **Sampling**: any :mod:`dpfy.sampling` sampler over the U user *indices*
   (``dataset_size`` = number of users), declaring the unit (``make_sampler(..., unit="user")``),
   so every ``SampleSpec`` in the ledger says ``unit="user"`` and ``dataset_size`` = U.
3. **Contribution bounding** (:class:`~dpfy.training.step.PrivateGradient` with
   ``microbatch_mode="sum"`` and ``microbatch_size = cap``): the gradients of a user's rows
   are summed (``reduction="sum"``) or averaged over the user's own number of used examples
   n_u (``reduction="mean"``: each row's loss is scaled by 1/n_u, a function of that user's
   data alone), and that one vector is clipped to C. The clipped per-user vectors are summed,
   noised with N(0, (z C)^2) and divided by the *expected* number of users per batch.
4. **Sensitivity**: adding or removing one user adds or removes exactly one clipped vector,
   so the add/remove L2 sensitivity is C (not 2C as for microbatch averages: no other user's
   vector changes), recorded by a plain ``GaussianSumQuery(C, z)``.

What the guarantee says about one *example* is a separate, weaker-looking but valid statement:
removing one example changes one user's data, i.e. remove that user and add it back without
the example, two user-level steps (group privacy of size 2, whatever the cap;
``dpfy.accounting.group``). The report states both, each labelled.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import torch

from dpfy._validate import check_int
from dpfy.randomness import Randomness
from dpfy.sampling.base import check_unit
from dpfy.training.data import PhysicalBatch
from dpfy.training.loader import _fetch, _to, chunk_rows, split_batch
from dpfy.training.step import PrivateGradient
from dpfy.training.trainer import PrivateTrainer

UserReduction = Literal["sum", "mean"]
#: How a user's per-example gradients become the one vector that is clipped.
REDUCTIONS = ("sum", "mean")


def check_user_ids(user_ids: Any, num_examples: int, name: str = "user_ids") -> np.ndarray:
    """``user_ids`` as an int64 array of one id per example, or a clear error.

    Raises:
      ValueError: missing (None), not one-dimensional, or not ``num_examples`` long.
      TypeError: not integer (floats, even integral ones, booleans and strings are refused:
        a rounded or parsed id could merge two users).
    """
    if user_ids is None:
        raise ValueError(
            f"{name} is missing: user-level DP needs one integer user id per example "
            f"({num_examples} examples)"
        )
    if isinstance(user_ids, torch.Tensor):
        if user_ids.is_floating_point() or user_ids.is_complex() or user_ids.dtype == torch.bool:
            raise TypeError(f"{name} must be integer user ids, got a tensor of {user_ids.dtype}")
        arr = user_ids.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(user_ids)
        except (TypeError, ValueError) as err:
            raise TypeError(f"{name} must be an array of integer user ids: {err}") from None
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(
            f"{name} must be integer user ids (one per example), got dtype {arr.dtype}"
        )
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(arr.shape)}")
    if len(arr) != num_examples:
        raise ValueError(
            f"{name} must have one id per example: len({name}) must be {num_examples}, got "
            f"{len(arr)}"
        )
    return arr.astype(np.int64, copy=False)


def check_cap(cap: Any, name: str = "max_examples_per_user") -> int | None:
    """A cap on examples per user: None (no cap) or an integer >= 1."""
    if cap is not None:
        check_int(name, cap)
        return int(cap)
    return None


def synthetic_user_ids(num_examples: int, num_users: int) -> np.ndarray:
    """Public synthetic ids for tests and demos: example i belongs to user ``i % num_users``."""
    check_int("num_examples", num_examples)
    check_int("num_users", num_users, 1, num_examples)
    return np.arange(num_examples, dtype=np.int64) % int(num_users)


@dataclasses.dataclass(frozen=True, eq=False)
class UserLayout:
    """The examples of each user as ``cap`` row slots (see the module docstring).

    Attributes:
      unit: the name of the unit of privacy (``"user"``, ``"movie"``).
      ids: int64 ``[U]``, the user id of user index u (increasing).
      slots: int64 ``[U, cap]``, the example index in each slot, -1 for a padding slot.
      counts: int64 ``[U]``, the examples used per user (at most ``cap``).
      num_examples: examples in the data (used or not).
      cap: slots per user (the given cap, else the largest user's count).
      cap_given: whether ``cap`` was a given bound (else every example is used).
      users_capped: users that had more than ``cap`` examples (a random subset was kept).
      subset_randomness: what drew the subsets (``Randomness.describe()``), or why none was.
    """

    unit: str
    ids: np.ndarray
    slots: np.ndarray
    counts: np.ndarray
    num_examples: int
    cap: int
    cap_given: bool
    users_capped: int
    subset_randomness: str

    @property
    def num_users(self) -> int:
        return int(len(self.ids))

    @property
    def num_used(self) -> int:
        """Examples actually read in training (sum of ``counts``)."""
        return int(self.counts.sum())

    @property
    def digest(self) -> str:
        """SHA-256 of the used example indices per user (which examples the run could read)."""
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.ids, dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(np.sort(self.slots, axis=1), dtype="<i8").tobytes())
        return h.hexdigest()

    def facts(self, reduction: str) -> dict[str, Any]:
        """What the ledger records about the grouping (metadata key ``user_level``): N in
        units (a public assumption of the statement) and the configuration, nothing else.

        The example counts, the largest unit, how many units were capped and the layout's
        hash are computed from the private data without noise (the hash tells neighbouring
        data sets apart exactly): they are :meth:`private_facts`, kept for the private
        diagnostics only."""
        return {
            "unit": self.unit,
            "num_users": self.num_users,
            "max_examples_per_user": self.cap if self.cap_given else None,
            "reduction": reduction,
            "subset": (
                f"a uniformly random subset of {self.cap} examples of each {self.unit} that "
                f"has more, drawn once before training from {self.subset_randomness}"
                if self.cap_given
                else f"every example of each {self.unit} used"
            ),
        }

    def private_facts(self) -> dict[str, Any]:
        """The grouping's facts computed from the private data (see :meth:`facts`)."""
        return {
            "num_examples": int(self.num_examples),
            "num_examples_used": self.num_used,
            "largest_user": int(self.counts.max()) if self.num_users else 0,
            "users_capped": int(self.users_capped),
            "layout_sha256": self.digest,
        }

    def to_state(self) -> dict[str, Any]:
        return {"unit": self.unit, "ids": self.ids.tolist(), "slots": self.slots.tolist(),
                "num_examples": int(self.num_examples), "cap_given": self.cap_given,
                "users_capped": int(self.users_capped),
                "subset_randomness": self.subset_randomness}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> UserLayout:
        slots = np.asarray(state["slots"], dtype=np.int64)
        return cls(
            unit=str(state["unit"]), ids=np.asarray(state["ids"], dtype=np.int64), slots=slots,
            counts=(slots >= 0).sum(1).astype(np.int64), num_examples=int(state["num_examples"]),
            cap=int(slots.shape[1]), cap_given=bool(state["cap_given"]),
            users_capped=int(state["users_capped"]),
            subset_randomness=str(state["subset_randomness"]),
        )


def group_by_user(
    user_ids: Any,
    *,
    max_examples_per_user: int | None = None,
    unit: str = "user",
    randomness: Randomness | None = None,
) -> UserLayout:
    """Lay out each user's examples as ``cap`` slots, keeping a random subset of larger users.

    Args:
      user_ids: one integer id per example (numpy array, tensor or list).
      max_examples_per_user: the cap k >= 1 (None: no cap; every example is used and the cap
        is the largest user's count).
      unit: the name of the unit of privacy (``"user"``, ``"movie"``).
      randomness: draws the subsets of users above the cap (default: the secure generator).

    Raises:
      ValueError / TypeError: see :func:`check_user_ids`; a cap below 1; a bad unit.
    """
    check_unit(unit)
    cap = check_cap(max_examples_per_user)
    if user_ids is None:
        check_user_ids(None, 0)
    n = len(user_ids)
    if n < 1:
        raise ValueError("user_ids must hold at least one example, got an empty sequence")
    ids = check_user_ids(user_ids, n)
    uniq, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")  # examples grouped by user, in data order
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    width = int(counts.max()) if cap is None else cap
    slots = np.full((len(uniq), width), -1, dtype=np.int64)
    capped = np.flatnonzero(counts > width)
    rng = None
    if len(capped):
        rng = randomness if randomness is not None else Randomness.secure_mode()
    for u in range(len(uniq)):
        mine = order[starts[u] : starts[u] + counts[u]]
        if counts[u] > width:
            assert rng is not None
            mine = np.sort(mine[rng.choice(int(counts[u]), width)])
        slots[u, : len(mine)] = mine
    return UserLayout(
        unit=unit, ids=uniq.astype(np.int64), slots=slots,
        counts=np.minimum(counts, width).astype(np.int64), num_examples=n, cap=width,
        cap_given=cap is not None, users_capped=int(len(capped)),
        subset_randomness=rng.describe() if rng is not None else "none (no user above the cap)",
    )


def user_level_options(
    unit: str,
    user_ids: Any,
    *,
    max_examples_per_user: int | None,
    reduction: str,
    randomness: Randomness | None,
) -> tuple[int, dict[str, Any]]:
    """(number of units, the extra :class:`UserLevelTrainer` arguments) of a recipe run.

    Checks everything first (unit, ids, cap, reduction), so a recipe refuses bad input before
    it builds a sampler or writes a file.
    """
    check_unit(unit)
    check_cap(max_examples_per_user)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {{sum, mean}}, got reduction={reduction!r}")
    if user_ids is None:
        check_user_ids(None, 0)
    ids = check_user_ids(user_ids, len(user_ids))
    return int(len(np.unique(ids))), {
        "user_ids": ids, "max_examples_per_user": max_examples_per_user,
        "reduction": reduction, "unit": unit, "layout_randomness": randomness,
    }


#: A user-level recipe's default expected batch is its example-level default, but at most
#: ``units // MIN_USER_STEPS_PER_EPOCH`` units (at least 1): an epoch has at least 8 steps. The
#: rotten-tomatoes default of 256 snippets over its 429 training movies would be 1.7 steps an
#: epoch; the rule gives 53 movies a step.
MIN_USER_STEPS_PER_EPOCH = 8


def recipe_batch_size(batch_size: int | None, default: int, units: int, unit: str) -> int:
    """The expected batch (units per step) of a recipe run over ``units`` units of privacy.

    ``batch_size`` None: ``default``, and for a user-level unit at most
    ``units // MIN_USER_STEPS_PER_EPOCH`` (at least 1). The batch is checked against ``units``
    here, the message naming the unit, so a recipe refuses it before it loads a model.
    """
    from dpfy.sampling.factory import check_batch_size

    if batch_size is None:
        batch_size = int(default)
        if unit != "example":
            batch_size = max(1, min(batch_size, int(units) // MIN_USER_STEPS_PER_EPOCH))
    check_batch_size(batch_size, units, unit)
    return int(batch_size)


def unit_description(unit: str, cap: int | None, example: str) -> str:
    """The ``unit_of_privacy`` metadata of a recipe run (``example``: what one row is)."""
    if unit == "example":
        return f"example ({example})"
    bound = f", at most {cap} used" if cap is not None else ""
    return f"{unit} (all of one {unit}'s {example}s{bound})"


class UserBatcher:
    """Physical batches of whole users: ``cap`` rows per user, padding slots of weight 0.

    Each chunk holds ``users_per_chunk`` users (``cap`` consecutive rows each; users of the
    last chunk that the batch does not fill are all padding). With a truncating sampler every
    step yields ``ceil(max_batch_size / users_per_chunk)`` chunks. ``row_scale`` of the last
    yielded chunk is 1/n_u on the rows of user u (``reduction="mean"``), else 1.

    Args:
      data: in-memory input tensor (with ``targets``) or a map-style ``Dataset``.
      targets: target tensor for tensor ``data``; None for a Dataset.
      layout: the :class:`UserLayout`.
      users_per_chunk: users per forward/backward pass.
      max_batch_size: the user sampler's truncation bound, or None.
      reduction: ``"sum"`` or ``"mean"``.
      collate_fn, device, target_key: as in :class:`dpfy.training.loader.DatasetBatcher`.
    """

    def __init__(
        self,
        data: Any,
        targets: torch.Tensor | None,
        layout: UserLayout,
        *,
        users_per_chunk: int,
        max_batch_size: int | None = None,
        reduction: UserReduction = "sum",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        device: torch.device | str | None = None,
        target_key: str = "labels",
    ) -> None:
        check_int("users_per_chunk", users_per_chunk)
        self.data, self.targets, self.layout = data, targets, layout
        self.users_per_chunk = int(users_per_chunk)
        self.max_batch_size = max_batch_size
        self.reduction = reduction
        self.collate_fn, self.target_key = collate_fn, target_key
        self.device = None if device is None else torch.device(device)
        self.row_scale: torch.Tensor | None = None

    @property
    def dataset_size(self) -> int:
        """Users (the sampler's indices)."""
        return self.layout.num_users

    def chunks(self, indices: np.ndarray) -> Iterator[PhysicalBatch]:
        """The physical batches of one logical batch of user indices."""
        users = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(users) and (users.min() < 0 or users.max() >= self.dataset_size):
            raise ValueError(
                f"indices must be user indices in [0, {self.dataset_size - 1}], got "
                f"min={users.min()}, max={users.max()}"
            )
        layout = self.layout
        for rows, count in chunk_rows(users, self.users_per_chunk, self.max_batch_size):
            slots = layout.slots[rows].copy()
            slots[count:] = -1  # padding users: every slot padding
            flat = slots.reshape(-1)
            real = flat >= 0
            index = np.where(real, flat, 0)
            if isinstance(self.data, torch.Tensor):
                assert self.targets is not None
                t = torch.from_numpy(index)
                x, y = self.data[t], self.targets[t]
                pad = torch.from_numpy(~real)
                x[pad] = 0
                y[pad] = 0
                x, y = _to((x, y), self.device or self.data.device)
            else:
                batch = _to(_fetch(self.data, index, self.collate_fn), self.device)
                x, y = split_batch(batch, self.target_key)
            w = torch.from_numpy(real.astype(np.float32))
            n_u = np.repeat(np.maximum(layout.counts[rows], 1), layout.cap)
            scale = np.where(real, 1.0 / n_u if self.reduction == "mean" else 1.0, 0.0)
            device = self.device if self.device is not None else (
                self.data.device if isinstance(self.data, torch.Tensor) else None
            )
            self.row_scale = torch.from_numpy(scale.astype(np.float32))
            if device is not None:
                w, self.row_scale = w.to(device), self.row_scale.to(device)
            yield PhysicalBatch(x, y, w, int(real.sum()))


class UserLevelTrainer(PrivateTrainer):
    """:class:`~dpfy.training.trainer.PrivateTrainer` with a user as the unit of privacy.

    Takes every argument of ``PrivateTrainer`` (``inputs``/``targets`` are still the
    *examples*; ``sampler`` must draw from the ``num_users`` user indices and declare the unit,
    e.g. ``make_sampler("poisson", layout.num_users, users_per_batch, unit="user")``;
    ``clip_norm`` bounds each user's reduced gradient; ``max_physical_batch_size`` is rows per
    pass, rounded down to whole users, at least one) and:

    Args:
      user_ids: one integer user id per example (see :func:`check_user_ids`).
      max_examples_per_user: the cap k >= 1 (None: no cap).
      reduction: ``"sum"`` (clip the sum of the user's gradients) or ``"mean"`` (their mean
        over the user's own used examples).
      unit: the name of the unit (must equal the sampler's ``unit``).
      layout_randomness: draws the subsets above the cap (default: the secure generator).

    Every argument is checked here, before any step runs or anything is written. The ledger's
    run metadata gains ``user_level`` (:meth:`UserLayout.facts`). Monitoring figures
    (``StepRecord.batch_size``: examples of the sampled users; with ``"mean"`` the loss is the
    1/n_u-weighted one) are not private, as in the base class.
    """

    def __init__(
        self,
        *args: Any,
        user_ids: Any,
        max_examples_per_user: int | None = None,
        reduction: UserReduction = "sum",
        unit: str = "user",
        layout_randomness: Randomness | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if reduction not in REDUCTIONS:
            raise ValueError(
                f"reduction must be one of {{sum, mean}}, got reduction={reduction!r}"
            )
        if self.microbatch_size is not None:
            raise ValueError(
                "microbatch_size must be None for user-level training (each user is its own "
                f"group of rows), got microbatch_size={self.microbatch_size!r}"
            )
        check_unit(unit)
        check_cap(max_examples_per_user)
        n = _num_examples(self.inputs)
        check_user_ids(user_ids, n)
        sampler_unit = getattr(self.sampler, "unit", "example")
        if sampler_unit != unit:
            raise ValueError(
                f"the sampler must draw {unit}s (make_sampler(..., unit={unit!r})), got a "
                f"sampler with unit={sampler_unit!r}"
            )
        self.reduction: UserReduction = reduction
        self._example_loss_fn = self.loss_fn  # per-example loss; "mean" wraps it in _setup
        self.layout = group_by_user(
            user_ids, max_examples_per_user=max_examples_per_user, unit=unit,
            randomness=layout_randomness,
        )
        self._check_args()  # the sampler against the number of users, before any step

    def sampler_size(self) -> int:
        """Users in the training data (checked against the sampler's ``dataset_size``)."""
        super_n = _num_examples(self.inputs)
        if isinstance(self.inputs, torch.Tensor) and (
            not isinstance(self.targets, torch.Tensor) or len(self.targets) != super_n
        ):
            raise ValueError("targets must be a tensor with one row per example of inputs")
        u = self.layout.num_users
        if int(self.sampler.dataset_size) != u:
            raise ValueError(
                f"the sampler must draw from the {u} {self.layout.unit}s of the data, got "
                f"sampler.dataset_size={self.sampler.dataset_size!r}"
            )
        return u

    def _setup(self) -> None:
        if self._ready:
            return
        super()._setup()
        cap = self.layout.cap
        self.private_gradient_ = PrivateGradient(
            self.model,
            self.query_,
            expected_batch_size=float(self.sampler.expected_batch_size) * cap,
            microbatch_size=cap,
            microbatch_mode="sum",
            forward=self.forward,
            precision=self.precision,
            loss_scale=self.loss_scale,
        )
        batcher = UserBatcher(
            self.inputs, self.targets, self.layout,
            users_per_chunk=max(1, int(self.max_physical_batch_size) // cap),
            max_batch_size=self.sampler.max_batch_size, reduction=self.reduction,
            collate_fn=self.collate_fn, device=self.device, target_key=self.target_key,
        )
        self.batcher_ = batcher
        if self.reduction == "mean":
            base = self._example_loss_fn

            def mean_loss(outputs: Any, targets: Any) -> torch.Tensor:
                scale = batcher.row_scale
                assert scale is not None  # set with the chunk being accumulated
                return base(outputs, targets) * scale.to(dtype=torch.float32)

            # its row scales belong to the whole chunk: not recomputable on one user's rows
            mean_loss.recomputable = False  # type: ignore[attr-defined]
            self.loss_fn = mean_loss

    def _run_facts(self) -> dict[str, Any]:
        facts = super()._run_facts()
        facts["user_level"] = self.layout.facts(self.reduction)
        facts["unit_of_privacy"] = (
            f"{self.layout.unit} (all of one {self.layout.unit}'s examples"
            + (f", at most {self.layout.cap} used" if self.layout.cap_given else "")
            + ")"
        )
        return facts

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["user_layout"] = self.layout.to_state()
        return state

    def load_state_dict(
        self, state: dict[str, Any], *, ledger_moved: bool = False, raise_budget: bool = False
    ) -> None:
        """Restore as the base class does, with the checkpoint's user layout (its subsets)."""
        if "user_layout" not in state:
            from dpfy.training.checkpoint import CheckpointMismatchError

            raise CheckpointMismatchError("the checkpoint holds no user layout")
        layout = UserLayout.from_state(state["user_layout"])
        if layout.num_users != self.layout.num_users or layout.unit != self.layout.unit:
            from dpfy.training.checkpoint import CheckpointMismatchError

            raise CheckpointMismatchError(
                f"the checkpoint's layout has {layout.num_users} {layout.unit}s, this trainer "
                f"{self.layout.num_users} {self.layout.unit}s"
            )
        self.layout = layout
        self._ready = False
        super().load_state_dict(state, ledger_moved=ledger_moved, raise_budget=raise_budget)


def _num_examples(inputs: Any) -> int:
    return len(inputs)


def private_facts(trainer: PrivateTrainer) -> dict[str, Any]:
    """The private diagnostics of a run's grouping (``{"user_level": ...}``, see
    :meth:`UserLayout.private_facts`); empty for an example-level trainer."""
    if isinstance(trainer, UserLevelTrainer):
        return {"user_level": trainer.layout.private_facts()}
    return {}
