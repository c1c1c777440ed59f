"""dpfy accounting vs Google's dp_accounting 0.6.0, side by side in one run.

Measurements (issue 2; add_or_remove adjacency, Poisson-subsampled Gaussian):

  (a) PLD epsilon, q=0.001, z=0.8, T=1e6, delta=1e-5: dpfy ``pld_epsilon`` at its default
      tolerance vs ``PLDAccountant()`` at its default discretisation (1e-4). Both errors are
      measured against a converged reference (dp_accounting at value_discretization_interval
      1e-5; ``--quick`` uses dpfy at tolerance 1e-5 instead). Goal: time ratio <= 0.25 at
      <= 0.5 % error.
  (b) Calibrating z for epsilon=8, delta=1e-5, q=0.01, T=1e4 with PLD: dpfy
      ``calibrate_noise_multiplier(method="pld")`` vs ``calibrate_dp_mechanism`` with
      ``PLDAccountant``. Goal: time ratio <= 0.1.
  (c) The same with RDP (dpfy method="rdp" vs ``RdpAccountant``). Goal: ratio <= 0.1.
  (d) Random allocation (Balls-and-Bins, 1-of-T), z=1: dpfy ``allocation_epsilon`` (provable
      upper bound and optimistic lower bound) vs PLD_accounting 2.0
      ``gaussian_allocation_epsilon_range`` (Feldman & Shenfeld 2026, default accuracy) at
      T=8 / 1 epoch / delta=1e-8, T=1000 / 1 epoch / delta=1e-5 and T=1000 / 100 epochs /
      delta=1e-5. Goal: time ratio <= 0.05 at an upper bound no larger than PLD_accounting's;
      <= 2 s (1 epoch) and <= 30 s (100 epochs) at T=1000. PLD_accounting runs in the
      interpreter given by ``--allocation-python`` (default: this one; it is much faster with
      numba, which pins an older NumPy than dpfy's, so a separate venv is typical), once per
      case (it takes minutes); ``--skip-allocation-reference`` times dpfy alone.

Each timing is the median of ``--repeats`` runs, dpfy and dp_accounting interleaved (the machine
is shared, so single timings are noisy). Prints a table; ``--json`` prints one JSON object.

    python benchmarks/accounting.py [--repeats 3] [--quick] [--json]
        [--allocation-python /path/to/venv/bin/python] [--skip-allocation-reference]
        [--only-allocation]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

Q_A, Z_A, T_A, DELTA = 0.001, 0.8, 1_000_000, 1e-5
EPS_B, Q_B, T_B = 8.0, 0.01, 10_000


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _median_pair(
    ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int
) -> tuple[float, float, Any, Any]:
    t_ours, t_theirs = [], []
    out_ours = out_theirs = None
    for _ in range(repeats):
        dt, out_ours = _timed(ours)
        t_ours.append(dt)
        dt, out_theirs = _timed(theirs)
        t_theirs.append(dt)
    return statistics.median(t_ours), statistics.median(t_theirs), out_ours, out_theirs


def _dpa_event(q: float, z: float, steps: int):
    from dp_accounting import dp_event

    return dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), steps
    )


def _ours_event(q: float, z: float, steps: int):
    from dpfy import events as ev

    return ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(z)), steps)


def bench_pld_epsilon(repeats: int, quick: bool) -> dict[str, Any]:
    from dp_accounting.pld import pld_privacy_accountant

    from dpfy.accounting import pld

    def ours() -> float:
        return pld.pld_epsilon(_ours_event(Q_A, Z_A, T_A), DELTA).epsilon

    def theirs(interval: float = 1e-4) -> float:
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
        return acc.compose(_dpa_event(Q_A, Z_A, T_A)).get_epsilon(DELTA)

    ours(), theirs()  # warm-up (imports, caches)
    t_ours, t_theirs, e_ours, e_theirs = _median_pair(ours, theirs, repeats)
    if quick:
        ref = pld.pld_epsilon(_ours_event(Q_A, Z_A, T_A), DELTA, tolerance=1e-5).epsilon
        ref_name = "dpfy pld at tolerance 1e-5"
    else:
        ref = theirs(1e-5)
        ref_name = "dp_accounting pld at value_discretization_interval 1e-5"
    return {
        "name": "pld_epsilon",
        "setting": f"q={Q_A}, z={Z_A}, T={T_A}, delta={DELTA}",
        "dpfy_seconds": t_ours,
        "dp_accounting_seconds": t_theirs,
        "ratio": t_ours / t_theirs,
        "goal_ratio": 0.25,
        "dpfy_epsilon": e_ours,
        "dp_accounting_epsilon": e_theirs,
        "reference_epsilon": ref,
        "reference": ref_name,
        "dpfy_rel_error": e_ours / ref - 1.0,
        "dp_accounting_rel_error": e_theirs / ref - 1.0,
    }


def bench_calibration(method: str, repeats: int) -> dict[str, Any]:
    from dp_accounting import mechanism_calibration
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    from dpfy.accounting import epsilon
    from dpfy.accounting.calibrate import calibrate_noise_multiplier

    def make_ours(z: float):
        return _ours_event(Q_B, z, T_B)

    def ours() -> float:
        return calibrate_noise_multiplier(make_ours, EPS_B, DELTA, method=method)

    if method == "pld":
        fresh = pld_privacy_accountant.PLDAccountant
    else:
        fresh = rdp_privacy_accountant.RdpAccountant

    def theirs() -> float:
        return mechanism_calibration.calibrate_dp_mechanism(
            fresh, lambda z: _dpa_event(Q_B, z, T_B), EPS_B, DELTA
        )

    ours()  # warm-up
    t_ours, t_theirs, z_ours, z_theirs = _median_pair(ours, theirs, repeats)
    eps_ours_at = {
        "dpfy_z": epsilon(make_ours(z_ours), DELTA, method=method).epsilon,
        "dp_accounting_z": epsilon(make_ours(z_theirs), DELTA, method=method).epsilon,
    }
    theirs_at = {
        "dpfy_z": fresh().compose(_dpa_event(Q_B, z_ours, T_B)).get_epsilon(DELTA),
        "dp_accounting_z": fresh().compose(_dpa_event(Q_B, z_theirs, T_B)).get_epsilon(DELTA),
    }
    return {
        "name": f"calibrate_{method}",
        "setting": f"target epsilon={EPS_B}, delta={DELTA}, q={Q_B}, T={T_B}",
        "dpfy_seconds": t_ours,
        "dp_accounting_seconds": t_theirs,
        "ratio": t_ours / t_theirs,
        "goal_ratio": 0.1,
        "dpfy_noise_multiplier": z_ours,
        "dp_accounting_noise_multiplier": z_theirs,
        "dpfy_epsilon_at": eps_ours_at,
        "dp_accounting_epsilon_at": theirs_at,
    }


ALLOCATION_CASES = [(8, 1.0, 1, 1e-8), (1000, 1.0, 1, 1e-5), (1000, 1.0, 100, 1e-5)]

_REFERENCE_SNIPPET = """
import json, sys, time
from PLD_accounting import gaussian_allocation_epsilon_range
t, z, k, d = json.loads(sys.argv[1])
t0 = time.perf_counter()
up, lo = gaussian_allocation_epsilon_range(delta=d, sigma=z, num_steps=t, num_epochs=k)
print(json.dumps({"upper": up, "lower": lo, "seconds": time.perf_counter() - t0}))
"""


def _allocation_reference(python: str, case: tuple[int, float, int, float]) -> dict[str, Any]:
    import subprocess

    out = subprocess.run(
        [python, "-c", _REFERENCE_SNIPPET, json.dumps(case)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_random_allocation(repeats: int, python: str | None) -> list[dict[str, Any]]:
    from dpfy.accounting.random_allocation import _one_epoch, allocation_epsilon

    rows = []
    for t, z, k, d in ALLOCATION_CASES:
        times = []
        for _ in range(repeats if k == 1 else 1):
            _one_epoch.cache_clear()  # time the full computation, not the cache
            dt, b = _timed(lambda: allocation_epsilon(z, t, k, d))  # noqa: B023
            times.append(dt)
        ref = _allocation_reference(python, (t, z, k, d)) if python else None
        ours_s = statistics.median(times)
        row: dict[str, Any] = {
            "name": f"random_alloc T{t}x{k}",
            "setting": f"Balls-and-Bins T={t}, z={z}, epochs={k}, delta={d}",
            "dpfy_seconds": ours_s,
            "dpfy_upper": b.upper,
            "dpfy_lower": b.lower,
            "goal_seconds": 2.0 if k == 1 else 30.0,
            "goal_ratio": 0.05,
        }
        if ref is not None:
            row.update(
                {
                    "dp_accounting_seconds": ref["seconds"],  # PLD_accounting's (table column)
                    "reference_upper": ref["upper"],
                    "reference_lower": ref["lower"],
                    "ratio": ours_s / ref["seconds"],
                }
            )
            row["goal_met"] = (
                row["ratio"] <= 0.05 and b.upper <= ref["upper"] and ours_s <= row["goal_seconds"]
            )
        else:
            row["goal_met"] = ours_s <= row["goal_seconds"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="skip the slow 1e-5 reference")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--allocation-python",
        default=sys.executable,
        help="interpreter with PLD_accounting 2.0 for the random-allocation reference",
    )
    parser.add_argument("--skip-allocation-reference", action="store_true")
    parser.add_argument("--only-allocation", action="store_true", help="only row (d)")
    args = parser.parse_args(argv)
    results: list[dict[str, Any]] = []
    if not args.only_allocation:
        try:
            import dp_accounting  # noqa: F401
        except ImportError:
            print(
                "dp_accounting 0.6.0 is needed: pip install dp-accounting==0.6.0",
                file=sys.stderr,
            )
            return 2
        results = [
            bench_pld_epsilon(args.repeats, args.quick),
            bench_calibration("pld", args.repeats),
            bench_calibration("rdp", args.repeats),
        ]
        for r in results:
            r["goal_met"] = r["ratio"] <= r["goal_ratio"]
        a = results[0]
        a["goal_met"] = a["goal_met"] and abs(a["dpfy_rel_error"]) <= 5e-3
    python = None if args.skip_allocation_reference else args.allocation_python
    results += bench_random_allocation(args.repeats, python)
    if args.json:
        print(json.dumps({"benchmark": "accounting", "repeats": args.repeats, "results": results}))
        return 0
    print(f"{'measurement':<18}{'dpfy s':>9}{'dp_acc s':>10}{'ratio':>8}{'goal':>7}  details")
    for r in results:
        if r["name"].startswith("random_alloc"):
            details = (
                f"{r['setting']}: dpfy upper {r['dpfy_upper']:.5f} lower {r['dpfy_lower']:.5f}"
            )
            if "reference_upper" in r:
                details += (
                    f"; PLD_accounting upper {r['reference_upper']:.5f} "
                    f"lower {r['reference_lower']:.5f}"
                )
            mark = "met" if r["goal_met"] else "MISSED"
            their = r.get("dp_accounting_seconds", float("nan"))
            print(
                f"{r['name'][:18]:<18}{r['dpfy_seconds']:>9.3f}{their:>10.3f}"
                f"{r.get('ratio', float('nan')):>8.3f}{r['goal_ratio']:>7.2f}  {mark}; {details}"
            )
            continue
        if r["name"] == "pld_epsilon":
            details = (
                f"eps dpfy {r['dpfy_epsilon']:.6f} ({100 * r['dpfy_rel_error']:+.3f} %), "
                f"dp_accounting {r['dp_accounting_epsilon']:.6f} "
                f"({100 * r['dp_accounting_rel_error']:+.3f} %), ref {r['reference_epsilon']:.6f}"
            )
        else:
            details = (
                f"z dpfy {r['dpfy_noise_multiplier']:.6f} (eps {r['dpfy_epsilon_at']['dpfy_z']:.6f}"
                f"; dp_acc says {r['dp_accounting_epsilon_at']['dpfy_z']:.6f}), "
                f"z dp_accounting {r['dp_accounting_noise_multiplier']:.6f} "
                f"(eps {r['dp_accounting_epsilon_at']['dp_accounting_z']:.6f}"
                f"; dpfy says {r['dpfy_epsilon_at']['dp_accounting_z']:.6f})"
            )
        mark = "met" if r["goal_met"] else "MISSED"
        print(
            f"{r['name']:<18}{r['dpfy_seconds']:>9.3f}{r['dp_accounting_seconds']:>10.3f}"
            f"{r['ratio']:>8.3f}{r['goal_ratio']:>7.2f}  {mark}; {details}"
        )
    if results and results[0].get("reference"):
        print(f"reference for (a): {results[0]['reference']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
