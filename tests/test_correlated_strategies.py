"""The registry of correlated-noise strategies (dpfy.correlated.strategy).

Oracles: the NumPy streams of ``tests/correlated_oracles.py`` (written from each strategy's
recursion, no shared code with the torch streams) fed the same draws, the registry's own
refusals, a strategy plugged in by one registration and run end to end, and an AST scan of
``src/dpfy`` for dispatch on strategy names outside the registry.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from correlated_oracles import BandMFNoise, BLTNoise, EfficientTreeNoise, TreeNoise

from dpfy import accounting
from dpfy.correlated import Cyclic, SingleEpoch, Strategy, make_plan, register_strategy
from dpfy.correlated.plan import CorrelatedPlan
from dpfy.correlated.schemas import sensitivity
from dpfy.correlated.strategy import (
    NoiseStream,
    find_strategy,
    strategy_names,
    unregister_strategy,
)
from dpfy.ledger import Ledger
from dpfy.queries.correlated import CorrelatedNoiseQuery
from dpfy.randomness import Randomness
from dpfy.sampling import CyclicSampler

SRC = Path(__file__).resolve().parents[1] / "src" / "dpfy"
REGISTRY = SRC / "correlated" / "strategy.py"
BUILT_IN = ("bandmf", "blt", "tree", "tree-efficient")


def _oracle(plan: CorrelatedPlan, size: int, std: float, seed: int) -> object:
    rng = np.random.default_rng(seed)
    return {
        "bandmf": lambda: BandMFNoise(plan.rule, (size,), std, rng),  # type: ignore[arg-type]
        "blt": lambda: BLTNoise(plan.rule, (size,), std, rng),  # type: ignore[arg-type]
        "tree": lambda: TreeNoise((size,), std, rng),
        "tree-efficient": lambda: EfficientTreeNoise((size,), std, rng),
    }[plan.strategy]()


def test_built_in_strategies_are_registered_in_order() -> None:
    from dpfy.config import MECHANISMS  # the names dpfy train accepts

    assert strategy_names()[:4] == BUILT_IN
    assert MECHANISMS[1:] == BUILT_IN
    for name in BUILT_IN:
        assert find_strategy(name).name == name


# -- the one torch stream against the NumPy oracle --------------------------------------------
@pytest.mark.parametrize("strategy", BUILT_IN)
def test_torch_stream_equals_the_numpy_oracle(strategy: str, monkeypatch) -> None:
    """Same draws in the same order (the efficient tree: the nodes ending at t + 1, level
    0 first); BLT in chunks of 7 values so that chunk edges and the fused add are crossed;
    then a resumed stream continues bit for bit."""
    monkeypatch.setattr("dpfy.correlated.blt._CHUNK", 7)
    steps, size, std = 13, 20, 0.6
    params = {"bandmf": {"coeffs": (1.0, 0.5, 0.25, 0.1)},
              "blt": {"omega": (-0.4, -0.1, -0.05), "theta": (0.8, 0.3, 0.1)}}
    plan = CorrelatedPlan(strategy, params.get(strategy, {}), steps, SingleEpoch())
    oracle = _oracle(plan, size, std, seed=2)
    rng = np.random.default_rng(2)
    z = torch.empty(size, dtype=torch.float64)

    def refill() -> None:
        z.copy_(torch.from_numpy(std * rng.standard_normal(size)))

    stream = plan.rule.stream(steps, size, z, torch)
    assert isinstance(stream, NoiseStream) and stream.buf.shape[0] == plan.rule.state_rows(steps)
    src = torch.linspace(-1.0, 1.0, size, dtype=torch.float64)
    outs = []
    for t in range(steps):
        if t == 6:
            state, draws_at = stream.state_dict(), rng.bit_generator.state
        refill()
        dst = torch.full((size,), math.nan, dtype=torch.float64)

        def add(a: int, b: int, w: torch.Tensor, dst: torch.Tensor = dst) -> None:
            assert dst[a:b].isnan().all(), "each value is added once"
            torch.add(src[a:b], w, alpha=0.5, out=dst[a:b])

        outs.append(stream.next(z, refill=refill, add=add).clone())
        want = oracle.next()  # type: ignore[attr-defined]
        np.testing.assert_allclose(outs[-1].numpy(), want, rtol=0, atol=1e-12)
        np.testing.assert_allclose(dst.numpy(), src.numpy() + 0.5 * want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="covers steps=13"):
        stream.next(z, refill=refill)
    # a fresh stream resumed from the state at step 6 continues bit for bit
    again = plan.rule.stream(steps, size, z, torch)
    again.load_state_dict(state)
    rng.bit_generator.state = draws_at
    for t in range(6, steps):
        refill()
        assert torch.equal(again.next(z, refill=refill), outs[t])


# -- the registry -------------------------------------------------------------------------------
def test_registry_refuses_surprises() -> None:
    from dpfy.correlated.bandmf import BandMF

    with pytest.raises(ValueError, match="already registered"):
        register_strategy(type("Other", (BandMF,), {}))  # same name "bandmf", another class
    assert register_strategy(BandMF) is BandMF  # the very same class: a no-op
    with pytest.raises(ValueError, match="Strategy subclass"):
        register_strategy(int)  # type: ignore[type-var]
    with pytest.raises(ValueError, match=r"strategy must be one of \{bandmf, blt, tree"):
        make_plan("banded", 10, SingleEpoch())
    with pytest.raises(ValueError, match="strategy must be one of"):
        CorrelatedPlan("nope", {}, 10, SingleEpoch())
    with pytest.raises(ValueError, match=r"params of 'blt' must have the keys \['omega'"):
        CorrelatedPlan("blt", {"coeffs": (1.0,)}, 10, SingleEpoch())


class _Identity(Strategy):
    """``C = I``: DP-SGD's independent noise, as a strategy (a plug-in for the test)."""

    name = "identity-test"

    @classmethod
    def from_params(cls, params, steps):  # type: ignore[no-untyped-def]
        return cls()

    @classmethod
    def optimised(cls, steps, schema, *, band, buffers, maxiter):  # type: ignore[no-untyped-def]
        return cls()

    def params(self) -> dict[str, tuple[float, ...]]:
        return {}

    def strategy_matrix(self, steps: int) -> np.ndarray:
        return np.eye(steps)

    def noise_map(self, steps: int) -> np.ndarray:
        return np.eye(steps)

    def apply(self, u: np.ndarray) -> np.ndarray:
        return np.asarray(u, dtype=float)

    def sensitivity(self, steps: int) -> float:
        return 1.0

    def prefix_error(self, steps: int) -> float:
        return steps * (steps + 1) / 2

    def state_rows(self, steps: int) -> int:
        return 0

    def stream(self, steps: int, size: int, like: torch.Tensor, xp: object) -> NoiseStream:
        return _IdentityStream(steps, size, 0, like)


class _IdentityStream(NoiseStream):
    def _next(self, z, refill, add):  # type: ignore[no-untyped-def]
        return self.w.copy_(z)


def test_a_new_strategy_is_one_class_and_one_registration(tmp_path) -> None:
    """Registered, the plug-in is planned, released, recorded, resolved from the ledger
    file and compared like a built-in; unregistered, its name is refused again."""
    register_strategy(_Identity)
    try:
        plan = make_plan("identity-test", 8, Cyclic(4))
        assert plan.sensitivity == pytest.approx(math.sqrt(2))  # two epochs, C = I
        assert plan.sensitivity == pytest.approx(sensitivity(np.eye(8), Cyclic(4)))
        ledger = Ledger(tmp_path / "ledger.jsonl", fsync=False)
        query = CorrelatedNoiseQuery(plan, clip_norm=1.0, noise_multiplier=2.0)
        spec, rng = CyclicSampler(8, 2).sample_spec(), Randomness(0)
        for t in range(8):
            sid = ledger.record_sample(spec, epoch=t // 4, step=t)
            out = query.add_noise({"w": torch.zeros(3)}, ledger=ledger, sample_id=sid,
                                  randomness=rng)
            assert out["w"].abs().sum() > 0
        ledger.close()
        event = Ledger.load(tmp_path / "ledger.jsonl").to_event()
        assert event == plan.event(2.0) and event.strategy == "identity-test"
        eps = accounting.epsilon(event, 1e-5, method="gaussian").epsilon
        assert eps == pytest.approx(
            accounting.epsilon(plan.event(2.0), 1e-5, method="gaussian").epsilon
        )
    finally:
        unregister_strategy("identity-test")
    with pytest.raises(ValueError, match="strategy must be one of"):
        make_plan("identity-test", 8, Cyclic(4))


# -- no dispatch on strategy names outside the registry ----------------------------------------
def _string_dispatch(tree: ast.AST, names: frozenset[str]) -> list[int]:
    """Lines that compare with a strategy (``x.strategy == ...``, ``strategy in ...``), compare
    with a strategy's name, or key a dict literal by one."""

    def is_strategy(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "strategy") or (
            isinstance(node, ast.Attribute) and node.attr == "strategy"
        )

    def is_name(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(is_name(e) for e in node.elts)
        return False

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(is_strategy(o) or is_name(o) for o in operands):
                lines.append(node.lineno)
        elif isinstance(node, ast.Dict):
            if any(k is not None and is_name(k) for k in node.keys):
                lines.append(node.lineno)
    return lines


def test_no_string_dispatch_on_strategies_outside_the_registry() -> None:
    names = frozenset(strategy_names())
    planted = ast.parse(
        'if plan.strategy == "bandmf": pass\n'
        'if strategy in ("tree", "x"): pass\n'
        'hint = {"blt": 1}\n'
        'if name != "tree-efficient": pass\n'
        'if mechanism != "dpsgd": pass\n'
    )
    assert _string_dispatch(planted, names) == [1, 2, 3, 4]  # the scan sees each kind
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        quoted = any(f"{q}{n}{q}" in text for n in names for q in "\"'")
        if path == REGISTRY or not (quoted or "strategy" in text):  # (parsing all is slow)
            continue
        if lines := _string_dispatch(ast.parse(text), names):
            found[str(path.relative_to(SRC))] = lines
    assert found == {}, f"dispatch on strategy names outside the registry: {found}"
