"""Reference epsilons for Gaussian random allocation (1-of-T), computed once.

Run with a separate virtual environment holding the authors' package (it pins an older NumPy
than dpfy's, so it is not installed into dpfy's environment):

    python -m venv /tmp/ref && /tmp/ref/bin/pip install pld-accounting==2.0 random-allocation==1.0.5
    nice /tmp/ref/bin/python tests/accounting/vectors/make_random_allocation.py

Writes ``random_allocation.json`` beside this script: for each grid point (T, z, epochs,
delta) the PLD_accounting (Feldman & Shenfeld 2026) upper and lower epsilon bounds from
``gaussian_allocation_epsilon_range`` with its default accuracy, and the seconds it took.
Each point is appended as soon as it is done, so an interrupted run keeps what it computed
(and a rerun resumes). The stored file holds the first 17 points of GRID (computed with numba
on a shared 2-core machine; ``seconds`` is PLD_accounting's time there); the last three
(T=1000 x 50 epochs, twice, and T=8, z=0.5 x 50 epochs) were not finished: a later attempt
ran the first of them for two hours and the last for eight minutes without a result.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from PLD_accounting import gaussian_allocation_epsilon_range

# T in 8..1000, z in 0.5..5, epochs in 1..50, delta in 1e-10..1e-5 (the grid),
# covered by a spread of points rather than the full product (each point takes seconds to
# minutes in the reference).
GRID = [
    (8, 1.0, 1, 1e-8),
    (8, 0.5, 1, 1e-5),
    (8, 2.0, 1, 1e-10),
    (8, 5.0, 10, 1e-5),
    (8, 1.0, 50, 1e-10),
    (32, 0.7, 1, 1e-7),
    (32, 3.0, 5, 1e-10),
    (100, 1.0, 1, 1e-5),
    (100, 0.5, 1, 1e-10),
    (100, 2.0, 10, 1e-7),
    (100, 5.0, 50, 1e-5),
    (300, 1.5, 3, 1e-8),
    (1000, 1.0, 1, 1e-5),
    (1000, 0.5, 1, 1e-8),
    (1000, 2.0, 1, 1e-10),
    (1000, 5.0, 1, 1e-5),
    (1000, 1.0, 10, 1e-10),
    (1000, 0.8, 50, 1e-5),
    (1000, 3.0, 50, 1e-8),
    (8, 0.5, 50, 1e-5),
]


def main() -> None:
    out = pathlib.Path(__file__).with_name("random_allocation.json")
    done = json.loads(out.read_text()) if out.exists() else []
    seen = {(d["T"], d["z"], d["epochs"], d["delta"]) for d in done}
    for t, z, k, delta in GRID:
        if (t, z, k, delta) in seen:
            continue
        start = time.perf_counter()
        upper, lower = gaussian_allocation_epsilon_range(
            delta=delta, sigma=z, num_steps=t, num_epochs=k
        )
        secs = time.perf_counter() - start
        done.append(
            {
                "T": t,
                "z": z,
                "epochs": k,
                "delta": delta,
                "upper": upper,
                "lower": lower,
                "seconds": round(secs, 2),
                "reference": "PLD_accounting 2.0",
            }
        )
        out.write_text(json.dumps(done, indent=1) + "\n")
        print(t, z, k, delta, upper, lower, f"{secs:.1f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
