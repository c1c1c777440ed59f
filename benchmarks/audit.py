"""White-box canary audits of the real DP-SGD release: claims, lower bounds, wall times.

For claims epsilon = 1, 2, 4 at delta = 1e-5, z is calibrated so that one Gaussian release
(no subsampling) has exactly that epsilon; ``dpfy.audit.canary_audit`` then attacks one
release through PrivateGradient + GaussianSumQuery (60k-parameter Linear + Embedding canary
model). Measurements (issue 21, Done-when):

  (a) table: claim, z, lower bound (95 %), mu estimate, ceiling, wall time (one seed);
  (b) validity: 10 seeds x claims 1, 2, 4 at 99.9 % confidence, every bound <= claim;
  (c) tightness: z = 1, one release (true epsilon 4.38), the bound at ``--tight-trials``;
  (d) one-run audit of real ``dpfy train`` runs (``runs.train_and_report(...,
      audit_canaries=M)``: MNIST, 100 training images + M = 100 canaries, 8 epochs, batch 16,
      C = 1, lr 1, seeded): the Steinke and f-DP bounds vs the run's claim vs the ceilings,
      and the wall time of the whole run (training, white-box scoring, report).

    python benchmarks/audit.py [--trials 2000000] [--seeds 10] [--tight-trials 10000000] [--json]
    python benchmarks/audit.py --one-run-only [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from scipy.optimize import brentq

from dpfy.accounting.gaussian import gaussian_epsilon
from dpfy.audit import canary_audit
from dpfy.audit.canary import CanaryModel

DELTA = 1e-5


def z_for(claim: float) -> float:
    """Smallest z (safe side) of one Gaussian release with epsilon(DELTA) <= claim."""
    return brentq(lambda z: gaussian_epsilon(1.0 / z, DELTA) - claim, 0.3, 30.0, xtol=1e-10) + 1e-9


def _audit(z: float, trials: int, confidence: float, seed: int) -> tuple[Any, float]:
    start = time.perf_counter()
    res = canary_audit(
        1.0,
        z,
        delta=DELTA,
        trials=trials,
        confidence=confidence,
        seed=seed,
        model=CanaryModel(100, 100, 200, 250),
    )
    return res, time.perf_counter() - start


def one_run_rows(claims: tuple[float, ...] = (100.0, 8.0)) -> list[dict[str, Any]]:
    """(d): one real training run per claimed epsilon, audited in that run."""
    import tempfile

    from dpfy import runs
    from dpfy.config import RunConfig

    rows = []
    for claim in claims:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            run = runs.train_and_report(RunConfig(
                dataset="mnist", out=f"{tmp}/run", target_epsilon=claim, delta=DELTA,
                epochs=8, batch_size=16, train_limit=100, learning_rate=1.0, clip_norm=1.0,
                seed=0, audit_canaries=100, audit_guesses=20,
            ))
            sec = time.perf_counter() - start
        a = run.report.audit
        rows.append({
            "claim": float(run.report.epsilon),
            "z": float(run.model.noise_multiplier),
            "canaries": a["trials"],
            "guesses": a["guesses"],
            "correct": {r["score"]: r["correct"] for r in a["scores"]},
            "bound": a["epsilon_lower"],
            "ceiling": a["ceiling"],
            "fdp_bound": a["fdp_epsilon_lower"],
            "fdp_mu": a["fdp_mu_lower"],
            "fdp_ceiling": a["fdp_ceiling"],
            "seconds": sec,
        })
    return rows


def _print_one_run(rows: list[dict[str, Any]]) -> None:
    print("\nOne-run audit of real dpfy train runs (95 %, 100 canaries, 20 guesses, delta 1e-5)")
    print("| claim | z | correct (black, white) | bound | ceiling | f-DP bound (mu) | f-DP "
          "ceiling | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["correct"]
        print(
            f"| {r['claim']:.3g} | {r['z']:.3f} | {c['black-box']}, {c['white-box']} | "
            f"{r['bound']:.3f} | {r['ceiling']:.2f} | {r['fdp_bound']:.3f} ({r['fdp_mu']:.3f}) "
            f"| {r['fdp_ceiling']:.2f} | {r['seconds']:.0f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2_000_000)
    ap.add_argument("--validity-trials", type=int, default=500_000)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--tight-trials", type=int, default=10_000_000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one-run-only", action="store_true", help="only (d)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one_run_only:
        rows = one_run_rows()
        if args.json:
            print(json.dumps({"one_run": rows}))
        else:
            _print_one_run(rows)
        return
    out: dict[str, Any] = {"delta": DELTA, "table": [], "validity": {}, "tightness": {}}
    for claim in (1.0, 2.0, 4.0):
        z = z_for(claim)
        res, sec = _audit(z, args.trials, 0.95, 0)
        out["table"].append(
            {
                "claim": claim,
                "z": z,
                "bound": res.epsilon,
                "mu_lower": res.mu_lower,
                "true_mu": 1.0 / z,
                "ceiling": res.ceiling,
                "trials": res.trials,
                "seconds": sec,
            }
        )
    for claim in (1.0, 2.0, 4.0):
        z = z_for(claim)
        bounds = [_audit(z, args.validity_trials, 0.999, s)[0].epsilon for s in range(args.seeds)]
        out["validity"][str(claim)] = {"bounds": bounds, "all_below": max(bounds) <= claim}
    res, sec = _audit(1.0, args.tight_trials, 0.95, 3)
    out["tightness"] = {
        "z": 1.0,
        "true_epsilon": float(gaussian_epsilon(1.0, DELTA)),
        "bound": res.epsilon,
        "trials": res.trials,
        "seconds": sec,
        "ceiling": res.ceiling,
    }
    out["one_run"] = one_run_rows()
    if args.json:
        print(json.dumps(out))
        return
    print(f"White-box canary audit, one release, delta = {DELTA:g}, 95 % confidence")
    print("| claim | z | lower bound | mu estimate (true) | ceiling | trials | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in out["table"]:
        print(
            f"| {r['claim']:g} | {r['z']:.4f} | {r['bound']:.3f} | {r['mu_lower']:.3f} "
            f"({r['true_mu']:.3f}) | {r['ceiling']:.2f} | {r['trials']} | {r['seconds']:.1f} |"
        )
    print(f"\nValidity: {args.seeds} seeds per claim at 99.9 %, {args.validity_trials} trials")
    for claim, v in out["validity"].items():
        b = v["bounds"]
        print(
            f"  claim {claim}: max bound {max(b):.3f}, min {min(b):.3f}, all <= claim: "
            f"{v['all_below']}"
        )
    t = out["tightness"]
    print(
        f"\nTightness: z = 1, true epsilon {t['true_epsilon']:.3f}; bound {t['bound']:.3f} "
        f"from {t['trials']} trials in {t['seconds']:.1f} s"
    )
    _print_one_run(out["one_run"])


if __name__ == "__main__":
    main()
