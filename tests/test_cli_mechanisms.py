"""``dpfy calibrate/plan --compare-mechanisms`` and ``dpfy train --mechanism`` (5.16)."""

from __future__ import annotations

import json
import math

import pytest

from dpfy.accounting.gaussian import gaussian_epsilon
from dpfy.cli import main
from dpfy.config import RunConfig


def test_calibrate_compares_mechanisms_at_one_epsilon(capsys) -> None:
    code = main(["calibrate", "--target-epsilon", "2", "-n", "2000", "-b", "100",
                 "--delta", "1e-5", "--epochs", "2", "--compare-mechanisms", "--json"])
    assert code == 0
    rows = {(r["mechanism"], r["sampler"]): r for r in json.loads(capsys.readouterr().out)[
        "mechanisms"]}
    assert set(rows) == {("dpsgd", "poisson"), ("dpsgd", "shuffle"), ("bandmf", "cyclic"),
                         ("blt", "cyclic"), ("tree", "cyclic"), ("tree-efficient", "cyclic")}
    for r in rows.values():
        assert r["epsilon"] <= 2.0 and r["epsilon"] == pytest.approx(2.0, rel=1e-3)
    # DP-SGD under the shuffle bound: sqrt(epochs) / z GDP, an independent closed form
    z = rows[("dpsgd", "shuffle")]["noise_multiplier"]
    assert float(gaussian_epsilon(math.sqrt(2) / z, 1e-5)) == pytest.approx(2.0, rel=1e-3)
    # shuffled DP-SGD's prefix sums carry more noise than Poisson's at the same epsilon
    assert rows[("dpsgd", "shuffle")]["prefix_rmse"] > rows[("dpsgd", "poisson")]["prefix_rmse"]
    # the efficient tree releases every node: over two epochs more nodes hold both of an
    # example's steps than in the square tree, so a larger z, yet less prefix noise
    tree, eff = rows[("tree", "cyclic")], rows[("tree-efficient", "cyclic")]
    assert eff["noise_multiplier"] > tree["noise_multiplier"]
    assert eff["prefix_rmse"] < 0.9 * tree["prefix_rmse"]


@pytest.mark.parametrize("mechanism", ["bandmf", "dp-ftrl-tree"])
def test_train_mechanism_with_a_poisson_sampler_is_one_line_and_writes_nothing(
    mechanism: str, tmp_path, capsys
) -> None:
    out = tmp_path / "run"
    code = main(["train", "mnist", "--mechanism", mechanism, "--sampler", "poisson",
                 "--train-limit", "256", "--epochs", "1", "--batch-size", "64", "--seed", "0",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "cyclic" in err
    assert not (out / "ledger.jsonl").exists()


def test_train_mechanism_aliases_name_the_canonical_mechanism(tmp_path, monkeypatch) -> None:
    from dpfy import runs

    seen: list[tuple[str, str | None]] = []

    def fake(config: RunConfig, **kw: object) -> None:
        seen.append((config.mechanism, config.sampler_kind))
        raise ValueError("stop here")

    monkeypatch.setattr(runs, "train_and_report", fake)
    for given in ("dp-sgd", "dpsgd", "dp-ftrl-tree", "tree-efficient", "tree"):
        assert main(["train", "mnist", "--mechanism", given, "--out", str(tmp_path / "r")]) == 2
    assert seen == [("dpsgd", "poisson"), ("dpsgd", "poisson"), ("tree-efficient", "cyclic"),
                    ("tree-efficient", "cyclic"), ("tree", "cyclic")]


def test_compare_mechanisms_calibrates_each_with_its_tightest_accountant_and_says_which(
    capsys,
) -> None:
    """Poisson DP-SGD gets PLD's z (smaller than RDP's), and the printed table names it."""
    from dpfy import events as ev
    from dpfy.accounting import calibrate_noise_multiplier

    code = main(["calibrate", "--target-epsilon", "2", "-n", "2000", "-b", "100",
                 "--delta", "1e-5", "--epochs", "2", "--compare-mechanisms"])
    out = capsys.readouterr().out
    assert code == 0
    lines = {tuple(line.split()[:3]): line.split() for line in out.splitlines()
             if line.startswith(("dpsgd", "bandmf", "blt", "tree"))}

    def make(z: float) -> ev.Event:  # 2 epochs of 20 Poisson steps at q = 100 / 2000
        return ev.SelfComposed(ev.PoissonSampled(0.05, ev.Gaussian(z)), 40)

    pld = calibrate_noise_multiplier(make, 2.0, 1e-5, method="pld")
    rdp = calibrate_noise_multiplier(make, 2.0, 1e-5, method="rdp")
    assert pld < rdp  # RDP would charge DP-SGD extra noise
    row = lines[("dpsgd", "poisson", "pld")]
    assert float(row[3]) == pytest.approx(pld, abs=1e-4)  # printed to 4 decimals
    for name in ("bandmf", "blt", "tree", "tree-efficient"):
        assert (name, "cyclic", "gaussian") in lines  # exact GDP of the matrix mechanism
    assert "tightest accountant" in out


def test_calibrate_with_method_names_the_accountant_whose_z_it_returns() -> None:
    from dpfy import events as ev
    from dpfy.accounting import calibrate_noise_multiplier
    from dpfy.accounting.calibrate import calibrate_with_method

    def make(z: float) -> ev.Event:
        return ev.SelfComposed(ev.PoissonSampled(0.05, ev.Gaussian(z)), 40)

    z, method = calibrate_with_method(make, 2.0, 1e-5)
    assert method == "pld" and z == calibrate_noise_multiplier(make, 2.0, 1e-5)
    assert calibrate_with_method(make, 2.0, 1e-5, method="rdp") == (
        calibrate_noise_multiplier(make, 2.0, 1e-5, method="rdp"), "rdp")
