"""Reference epsilons from dp_accounting 0.6.0's RdpAccountant (its default orders).

Writes rdp_dp_accounting.json beside this script: for every (q, z, T, delta) of the grid in
the issue "the tightest provable number for every sampler" (q in [1e-5, 1], z in [0.3, 20],
T in [1, 1e6], delta in [1e-10, 1e-3]), dp_accounting's epsilon for T Poisson-subsampled
Gaussian steps. Run once (about a minute):

  PYTHONPATH=src python tests/accounting/vectors/make_rdp_dp_accounting.py
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import pathlib

from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp

QS = [1e-5, 1e-4, 1e-3, 0.01, 0.05, 0.2, 0.5, 1.0]
ZS = [0.3, 0.35, 0.5, 0.8, 1.0, 1.5, 3.0, 8.0, 20.0]
TS = [1, 10, 120, 1_000, 100_000, 1_000_000]
DELTAS = [1e-10, 1e-6, 1e-5, 1e-3]


def main() -> None:
    logging.getLogger("absl").setLevel(logging.ERROR)  # its non-converging fractional orders
    rows = []
    for q in QS:
        for z in ZS:
            gauss = de.GaussianDpEvent(z)
            inner = gauss if q == 1.0 else de.PoissonSampledDpEvent(q, gauss)
            for t in TS:
                acc = rdp.RdpAccountant()  # default orders
                acc.compose(de.SelfComposedDpEvent(inner, t))
                for d in DELTAS:
                    rows.append([q, z, t, d, float(acc.get_epsilon(d))])
    version = importlib.metadata.version("dp-accounting")
    head = {
        "source": f"dp_accounting {version} RdpAccountant, default orders",
        "columns": ["q", "z", "steps", "delta", "epsilon"],
    }
    lines = ",\n".join(json.dumps(r) for r in rows)
    text = json.dumps(head)[:-1] + ', "rows": [\n' + lines + "\n]}\n"
    pathlib.Path(__file__).with_name("rdp_dp_accounting.json").write_text(text)


if __name__ == "__main__":
    main()
