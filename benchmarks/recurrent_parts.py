"""Where dpfy's LSTM step goes: the recurrent rule's parts timed beside the plain step.

The model and batch of ``dpsgd_step.py --models lstm`` (Embedding(1000, 64) -> LSTM(64, 128)
-> last valid output -> 2 classes, batch 64, sequence 64). Timed in interleaved rounds (each
part once per round, median over rounds), on the CPU clock with one thread by default:

* ``plain``: forward, backward, SGD step; ``dpfy``: ``PrivateGradient`` accumulate + release +
  SGD step (attribution check off, as ``dpsgd_step.py``'s ``dpfy_nocheck``);
* ``module_forward``: the LSTM's own fused forward (no autograd); ``fused_backward``: the
  fused forward and backward with autograd, less ``module_forward``;
* the rule's parts on the same shapes: ``gates`` (recomputed from input and output: two GEMMs
  and the cell-state scan), ``bptt`` (backpropagation through time), ``input_grad`` (one
  GEMM), ``norms`` (shared-Gram ghost norms of ``W_ih``/``W_hh``), ``clipped_sum`` (the
  book-keeping GEMMs).

``floor = plain + gates + norms`` is what the rule adds when everything else costs what the
fused kernels do (the hand-written backward and the clipped sum redo the fused backward's
GEMMs; see ``benchmarks/results/dpsgd_step_mha_lstm/README.md``).

Usage::

    python benchmarks/recurrent_parts.py --rounds 15 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from dpfy.training.norms import recurrent_bptt as rb
from dpfy.training.norms.recurrent_grads import GateForm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import dpsgd_step  # noqa: E402  (the benchmark's model, batch and steps)


def parts() -> dict[str, Callable[[], object]]:
    """The timed callables (see the module docstring)."""
    torch.manual_seed(0)
    x, y = dpsgd_step.text_batch(64)
    plain = dpsgd_step.plain_step(dpsgd_step.make_lstm(), x, y)
    dpfy = dpsgd_step.dpfy_step(dpsgd_step.make_lstm(), x, y, attribution_check=0)
    steps, batch, d, hidden = dpsgd_step.SEQ_LEN, 64, dpsgd_step.WIDTH, 128
    lstm = torch.nn.LSTM(d, hidden)
    inp = torch.randn(steps, batch, d)
    inp_grad = inp.clone().requires_grad_()
    with torch.no_grad():
        out, _ = lstm(inp)
    w_ih, w_hh, b_ih, b_hh = (p.detach() for p in lstm.parameters())
    w = rb.Weights(w_ih, w_hh, b_ih, b_hh, None)
    where = rb.Steps(steps, batch)
    zero = torch.zeros(batch, hidden)
    g = rb.gates("lstm", inp, out, (zero, zero), w, where, False)
    d_out = torch.randn(steps, batch, hidden)
    back = rb.backward_through_time(g, d_out, None, where, False)
    weights = torch.rand(batch)
    names = ("w_ih", "w_hh", "b_ih", "b_hh")

    def module_forward() -> object:
        with torch.no_grad():
            return lstm(inp)

    def fused_both() -> object:
        o, _ = lstm(inp_grad)
        return torch.autograd.grad(o, [inp_grad, *lstm.parameters()], d_out)

    def norms() -> object:
        return GateForm(g.x, g.h_prev, back.gate, None, names).squared_norms()

    def clipped_sum() -> object:
        form = GateForm(g.x, g.h_prev, back.gate, None, names)
        return form.weighted_sum(dict.fromkeys(names, weights))

    return {
        "plain": plain,
        "dpfy": dpfy,
        "module_forward": module_forward,
        "fused_forward_backward": fused_both,
        "gates": lambda: rb.gates("lstm", inp, out, (zero, zero), w, where, False),
        "bptt": lambda: rb.backward_through_time(g, d_out, None, where, False),
        "input_grad": lambda: torch.matmul(back.gate, w.w_ih),
        "norms": norms,
        "clipped_sum": clipped_sum,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    fns = parts()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
        fn()
    order = list(fns)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            t0 = time.process_time()
            fns[name]()
            times[name].append(time.process_time() - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    med["fused_backward"] = med["fused_forward_backward"] - med["module_forward"]
    med["floor"] = med["plain"] + med["gates"] + med["norms"]
    for k, v in med.items():
        print(f"{k:24s} {v:8.2f} ms  {v / med['plain']:5.2f} x plain")
    if args.json:
        report = {"threads": args.threads, "clock": "cpu", "rounds": args.rounds,
                  "torch": torch.__version__, "median_ms": med}
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
