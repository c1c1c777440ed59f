"""``dpfy calibrate/plan --compare-mechanisms`` and ``dpfy train --mechanism`` (5.16)."""

from __future__ import annotations

import json
import math

import pytest

from dpfy.accounting.gaussian import gaussian_epsilon
from dpfy.cli import main


def test_calibrate_compares_mechanisms_at_one_epsilon(capsys) -> None:
    code = main(["calibrate", "--target-epsilon", "2", "-n", "2000", "-b", "100",
                 "--delta", "1e-5", "--epochs", "2", "--compare-mechanisms", "--json"])
    assert code == 0
    rows = {(r["mechanism"], r["sampler"]): r for r in json.loads(capsys.readouterr().out)[
        "mechanisms"]}
    assert set(rows) == {("dpsgd", "poisson"), ("dpsgd", "shuffle"), ("bandmf", "cyclic"),
                         ("blt", "cyclic"), ("tree", "cyclic")}
    for r in rows.values():
        assert r["epsilon"] <= 2.0 and r["epsilon"] == pytest.approx(2.0, rel=1e-3)
    # DP-SGD under the shuffle bound: sqrt(epochs) / z GDP, an independent closed form
    z = rows[("dpsgd", "shuffle")]["noise_multiplier"]
    assert float(gaussian_epsilon(math.sqrt(2) / z, 1e-5)) == pytest.approx(2.0, rel=1e-3)
    # shuffled DP-SGD's prefix sums carry more noise than Poisson's at the same epsilon
    assert rows[("dpsgd", "shuffle")]["prefix_rmse"] > rows[("dpsgd", "poisson")]["prefix_rmse"]


def test_train_mechanism_with_a_poisson_sampler_is_one_line_and_writes_nothing(
    tmp_path, capsys
) -> None:
    out = tmp_path / "run"
    code = main(["train", "mnist", "--mechanism", "bandmf", "--sampler", "poisson",
                 "--train-limit", "256", "--epochs", "1", "--batch-size", "64", "--seed", "0",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "cyclic" in err
    assert not (out / "ledger.jsonl").exists()
