"""Balls-and-Bins vs Poisson vs shuffle: epsilon at delta = 1e-5 after one epoch.

For T in {100, 1000, 10000} steps per epoch and z in {0.6, 0.8, 1, 1.5, 2}: the Balls-and-Bins
Monte Carlo estimate, upper confidence bound (error probability 1e-3) and certain lower bound;
Poisson subsampling with q = 1/T accounted by PLD (``dpfy.accounting.epsilon(method="pld")``,
RDP if PLD is unavailable); the shuffle lower bound of Chua et al. (2024a) and the
no-amplification upper bound; wall and CPU time of each (the machine may be shared: CPU
seconds include the pool workers). Goal (issue 4): T = 1000, z = 1 upper bound within 5 % of
the estimate in under 60 s on 2 cores. Then several epochs (training-like runs, default sample
counts): (z, T, E) in EPOCH_CONFIGS beside Poisson PLD at q = 1/T over T * E steps.

Writes ``benchmarks/results/balls_and_bins.png`` (epsilon vs z per T, like Chua et al. 2025,
Fig. 2) and ``balls_and_bins.json``.

    python benchmarks/balls_and_bins.py            # full grid (minutes)
    python benchmarks/balls_and_bins.py --quick    # T in {100, 1000}, 3 noise levels, fewer samples
    python benchmarks/balls_and_bins.py --json     # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DELTA = 1e-5


def _poisson(z: float, t: int) -> tuple[float, str, float]:
    from dpfy import accounting
    from dpfy import events as ev

    event = ev.SelfComposed(ev.PoissonSampled(1.0 / t, ev.Gaussian(z)), t)
    t0 = time.perf_counter()
    try:
        res = accounting.epsilon(event, DELTA, method="pld")
    except (ValueError, KeyError):  # pld not available: say so in the output
        res = accounting.epsilon(event, DELTA, method="rdp")
    return res.epsilon, res.method, time.perf_counter() - t0


def _samples(t: int, quick: bool, override: int | None) -> int:
    if override is not None:
        return override
    if quick:
        return {100: 100_000, 1000: 100_000}.get(t, 20_000)
    return {100: 250_000, 1000: 250_000}.get(t, 50_000)


# Several epochs (training-like runs): (z, steps per epoch, epochs); default sample counts.
EPOCH_CONFIGS = ((1.0, 59, 15), (2.0, 59, 15), (1.0, 235, 10), (0.8, 1000, 3))


def _cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (pool workers)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _mc(z: float, t: int, epochs: int, samples: int | None, workers: int,
        error_probability: float):
    """Monte Carlo epsilon on a fresh process pool, with (wall, CPU) seconds."""
    from dpfy.accounting.monte_carlo.accountant import balls_and_bins_epsilon

    wall, cpu = time.perf_counter(), _cpu_seconds()
    with ProcessPoolExecutor(workers) as pool:
        mc = balls_and_bins_epsilon(
            z, t, DELTA, epochs=epochs, samples=samples, seed=0,
            error_probability=error_probability, executor=pool, progress=sys.stderr.isatty(),
        )
    return mc, time.perf_counter() - wall, _cpu_seconds() - cpu


def run_epochs(workers: int, error_probability: float) -> list[dict]:
    """Several epochs: Balls-and-Bins (default samples) beside Poisson PLD at q = 1/T."""
    from dpfy import accounting
    from dpfy import events as ev

    rows = []
    for z, t, e in EPOCH_CONFIGS:
        mc, wall, cpu = _mc(z, t, e, None, workers, error_probability)
        event = ev.SelfComposed(ev.PoissonSampled(1.0 / t, ev.Gaussian(z)), t * e)
        t0 = time.perf_counter()
        pld = accounting.epsilon(event, DELTA, method="pld").epsilon
        row = {
            "noise_multiplier": z, "steps": t, "epochs": e,
            "bb_estimate": mc.epsilon_estimate, "bb_upper": mc.epsilon_upper,
            "bb_lower": mc.epsilon_lower, "bb_method": mc.method, "bb_samples": mc.samples,
            "bb_direction": mc.direction, "bb_wall_seconds": wall, "bb_cpu_seconds": cpu,
            "poisson_pld": pld, "poisson_seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        if not args_json:
            print(
                f"z={z:<4} T={t:>5} E={e:>3} BB est={mc.epsilon_estimate:.4f} "
                f"up={mc.epsilon_upper:.4f} low={mc.epsilon_lower:.4f} ({mc.method}, "
                f"{mc.samples} samples, bound from {mc.direction}, {wall:.1f}s wall, "
                f"{cpu:.1f}s CPU) | Poisson PLD {pld:.4f}",
                flush=True,
            )
    return rows


def run(quick: bool, samples: int | None, workers: int, error_probability: float) -> dict:
    from dpfy import events as ev
    from dpfy.accounting.gaussian import gaussian_epsilon
    from dpfy.accounting.shuffle import shuffle_lower_bound_epsilon

    steps = (100, 1000) if quick else (100, 1000, 10000)
    zs = (0.6, 1.0, 2.0) if quick else (0.6, 0.8, 1.0, 1.5, 2.0)
    rows = []
    for t in steps:
        for z in zs:
            n = _samples(t, quick, samples)
            mc, wall, cpu = _mc(z, t, 1, n, workers, error_probability)
            p_eps, p_method, p_time = _poisson(z, t)
            t0 = time.perf_counter()
            s_low = shuffle_lower_bound_epsilon(ev.Shuffled(z, t), DELTA)
            s_time = time.perf_counter() - t0
            row = {
                "steps": t,
                "noise_multiplier": z,
                "bb_estimate": mc.epsilon_estimate,
                "bb_upper": mc.epsilon_upper,
                "bb_lower": mc.epsilon_lower,
                "bb_gap": (mc.epsilon_upper / mc.epsilon_estimate - 1.0)
                if mc.epsilon_estimate > 0
                else math.inf,
                "bb_method": mc.method,
                "bb_samples": n,
                "bb_seconds": wall,
                "bb_cpu_seconds": cpu,
                "poisson_epsilon": p_eps,
                "poisson_method": p_method,
                "poisson_seconds": p_time,
                "shuffle_lower": s_low,
                "shuffle_seconds": s_time,
                "no_amplification": float(gaussian_epsilon(1.0 / z, DELTA)),
            }
            rows.append(row)
            if not args_json:
                _print_row(row)
    goal = [r for r in rows if r["steps"] == 1000 and r["noise_multiplier"] == 1.0]
    out = {
        "delta": DELTA,
        "error_probability": error_probability,
        "workers": workers,
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }
    if goal:
        g = goal[0]
        out["goal"] = {
            "gap": g["bb_gap"],
            "seconds": g["bb_seconds"],
            "cpu_seconds": g["bb_cpu_seconds"],
            "met": bool(g["bb_gap"] <= 0.05 and g["bb_seconds"] < 60.0),
        }
    return out


def _print_row(r: dict) -> None:
    print(
        f"T={r['steps']:>5} z={r['noise_multiplier']:<4} "
        f"BB est={r['bb_estimate']:.4f} up={r['bb_upper']:.4f} low={r['bb_lower']:.4f} "
        f"(+{100 * r['bb_gap']:.1f}%, {r['bb_method']}, {r['bb_samples']} samples, "
        f"{r['bb_seconds']:.1f}s wall, {r['bb_cpu_seconds']:.1f}s CPU) | "
        f"Poisson {r['poisson_method']}={r['poisson_epsilon']:.4f} "
        f"({r['poisson_seconds']:.2f}s) | shuffle low={r['shuffle_lower']:.4f} "
        f"({r['shuffle_seconds']:.2f}s) | no-amp={r['no_amplification']:.3f}",
        flush=True,
    )


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    steps = sorted({r["steps"] for r in rows})
    fig, axes = plt.subplots(1, len(steps), figsize=(5 * len(steps), 4), squeeze=False)
    for ax, t in zip(axes[0], steps, strict=True):
        rs = sorted((r for r in rows if r["steps"] == t), key=lambda r: r["noise_multiplier"])
        zs = [r["noise_multiplier"] for r in rs]

        def col(key, rs=rs):
            return [r[key] if math.isfinite(r[key]) else float("nan") for r in rs]

        ax.plot(zs, col("bb_upper"), "o-", color="C0", label="Balls-and-Bins upper (MC)")
        ax.plot(zs, col("bb_estimate"), "x--", color="C0", label="Balls-and-Bins estimate")
        ax.plot(zs, col("bb_lower"), "v:", color="C0", label="Balls-and-Bins lower")
        ax.plot(zs, col("poisson_epsilon"), "s-", color="C1",
                label=f"Poisson ({rs[0]['poisson_method'].upper()})")
        ax.plot(zs, col("shuffle_lower"), "^-", color="C3", label="Shuffle lower bound")
        ax.plot(zs, col("no_amplification"), "k:", label="no amplification")
        ax.set_yscale("log")
        ax.set_xlabel("noise multiplier z")
        ax.set_ylabel(f"epsilon at delta = {result['delta']:g}")
        ax.set_title(f"T = {t} steps (one epoch)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


args_json = False

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grid and sample counts")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--samples", type=int, default=None, help="Monte Carlo samples")
    parser.add_argument("--workers", type=int, default=2, help="processes for Monte Carlo")
    parser.add_argument("--error-probability", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-epochs", action="store_true", help="skip the several-epochs table")
    args = parser.parse_args()
    args_json = args.json
    result = run(args.quick, args.samples, args.workers, args.error_probability)
    if not args.no_epochs:
        result["several_epochs"] = run_epochs(args.workers, args.error_probability)
    name = "balls_and_bins_quick" if args.quick else "balls_and_bins"
    figure(result, args.out / f"{name}.png")
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    elif "goal" in result:
        g = result["goal"]
        print(
            f"goal (T=1000, z=1: upper within 5% of estimate in < 60 s): gap "
            f"{100 * g['gap']:.1f}% in {g['seconds']:.1f}s wall ({g['cpu_seconds']:.1f}s CPU) -> "
            f"{'met' if g['met'] else 'NOT met'}"
        )
