"""How fast can a DP-SGD step on the benchmark MLP be in eager PyTorch? A hand-written floor.

``dpsgd_step.py`` compares dpfy's general ``PrivateGradient`` with plain PyTorch. This script
answers a narrower question: how much of dpfy's ratio is the library's machinery, and how much
is the arithmetic that every DP-SGD step on this model must do? It times, in interleaved
rounds with the same harness:

* ``plain``: forward, backward, SGD step;
* ``floor``: a hand-written DP-SGD step for ``Linear`` layers only, with nothing but the
  necessary work -- forward with hooks, one backward pass to the layer outputs, ghost norms
  ``||a||^2 (||g||^2)``, flat clip weights with 1/B folded in, book-keeping GEMMs written
  straight into a flat gradient buffer, and dpfy's seeded Gaussian noise fused with the add
  (no ledger, no input checks, no microbatching, no support for other layers);
* ``floor_no_noise``: the same without the noise (the gradient is the clipped mean);
* ``dpfy``: ``PrivateGradient`` with ``GaussianSumQuery`` and the ledger, as in
  ``dpsgd_step.py``.

Before timing, the floor's noise-free gradient is checked against ``PrivateGradient`` with
``NoPrivacyQuery`` (it must be the same clipped mean), so the floor is not cheap by being wrong.

Usage::

    python benchmarks/dpsgd_floor.py [--rounds 40] [--clock cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
from dpsgd_step import CLIP, LR, MODELS, Z, dpfy_step, measure, plain_step, write_json
from torch import nn

from dpfy.ledger import Ledger
from dpfy.queries.sum import NoPrivacyQuery
from dpfy.randomness import Randomness
from dpfy.sampling import SampleSpec
from dpfy.training import PrivateGradient


def floor_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, noise: bool = True):
    """The minimal DP-SGD step for a model whose trainable layers are all ``nn.Linear``."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    params = [p for m in layers for p in (m.weight, m.bias)]
    if sum(p.numel() for p in params) != sum(p.numel() for p in model.parameters()):
        raise ValueError("the floor step handles models whose parameters are all in Linear layers")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    total = sum(p.numel() for p in params)
    acc, grad = torch.empty(total), torch.empty(total)
    acc_views, start = [], 0
    for p in params:
        acc_views.append(acc[start : start + p.numel()].view(p.shape))
        p.grad = grad[start : start + p.numel()].view(p.shape)
        start += p.numel()
    rng = Randomness(seed=0)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    batch = x.shape[0]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for m in layers:
        m.register_forward_hook(lambda mod, inp, out: seen.append((inp[0], out)))
    ones = torch.ones(batch)

    def step() -> None:
        seen.clear()
        losses = loss_fn(model(x), y)
        grads = torch.autograd.grad(losses, [out for _, out in seen], grad_outputs=ones)
        with torch.no_grad():
            sq = None
            for (a, _), g in zip(seen, grads, strict=True):
                # ||grad W||^2 + ||grad b||^2 = (||a||^2 + 1) ||g||^2 for one position
                a_sq = torch.linalg.vector_norm(a.reshape(batch, -1), dim=1).square_().add_(1.0)
                term = a_sq.mul_(torch.linalg.vector_norm(g, dim=1).square_())
                sq = term if sq is None else sq.add_(term)
            w = torch.clamp_(CLIP / sq.sqrt_(), max=1.0).mul_(1.0 / batch).unsqueeze(1)
            for i, ((a, _), g) in enumerate(zip(seen, grads, strict=True)):
                gw = g * w
                acc_views[2 * i].addmm_(gw.t(), a.reshape(batch, -1), beta=0.0)
                torch.sum(gw, 0, out=acc_views[2 * i + 1])
            if noise:
                rng.normal_([grad], [Z * CLIP / batch], add=[acc])
            else:
                grad.copy_(acc)
        opt.step()

    return step


def floor_no_noise_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    return floor_step(model, x, y, noise=False)


BUILDERS = {
    "plain": plain_step,
    "floor": floor_step,
    "floor_no_noise": floor_no_noise_step,
    "dpfy": dpfy_step,
}


def check_floor(x: torch.Tensor, y: torch.Tensor) -> float:
    """Relative L2 error between the floor's noise-free gradient and PrivateGradient's."""
    torch.manual_seed(0)
    base = MODELS["mlp"]()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    floor_no_noise_step(a, x, y)()  # one step: grads written, parameters moved
    pg = PrivateGradient(b, NoPrivacyQuery(CLIP), expected_batch_size=x.shape[0])
    pg.accumulate(x, y, nn.CrossEntropyLoss(reduction="none"))
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=60_000, sampling_rate=0.01))
    pg.release(ledger=ledger, sample_id=sid, randomness=Randomness(seed=0))
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    num = sum(float((p.grad - q.grad).pow(2).sum()) for p, q in pairs)
    den = sum(float(q.grad.pow(2).sum()) for q in b.parameters())
    return (num / den) ** 0.5


#: Parts of dpfy's step named in the profile: (label, file suffix, function name).
PARTS = (
    ("accumulate (whole chunk)", "training/step.py", "_accumulate_one"),
    ("  forward, hooks recording", "modules/module.py", "_call_impl"),
    ("  backward to the layer outputs", "norms/capture.py", "backward"),
    ("  layout check (batch dimension)", "norms/layout.py", "settle"),
    ("  rules' linear forms", "training/step.py", "_layer_grads"),
    ("  squared norms", "training/step.py", "_squared_norms"),
    ("  clip weights (query)", "training/step.py", "_clip_weights"),
    ("  clipped sums (book-keeping GEMMs)", "training/step.py", "_add_weighted_sums"),
    ("  attribution check (alone pass)", "norms/attribution.py", "run"),
    ("release", "training/step.py", "release"),
    ("  noise (seeded Philox, Box-Muller)", "dpfy/randomness.py", "_normal32_into"),
    ("  flat buffers (new p.grad)", "training/step.py", "_flat_buffers"),
    ("ledger.record_sample", "ledger/ledger.py", "record_sample"),
    ("optimizer step", "torch/optim/optimizer.py", "wrapper"),
)


#: The arithmetic both the floor and dpfy do, by the builtin (or dpfy function) doing it.
WORK = (
    ("forward GEMMs (linear)", "~", "<built-in method torch._C._nn.linear>"),
    ("backward (autograd engine)", "~",
     "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
    ("clipped-sum GEMMs (addmm_)", "~", "<method 'addmm_' of 'torch._C.TensorBase' objects>"),
    ("noise (Randomness)", "dpfy/randomness.py", "_normal32_into"),
)


def profile(x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, float]:
    """cProfile (CPU clock) of ``steps`` dpfy steps and as many floor steps: milliseconds per
    step of each of :data:`PARTS` (cumulative, so nested parts add up to their parent), the
    profiled totals of both, and the calls into torch per step.

    cProfile's own overhead falls on Python calls, so it inflates dpfy (more Python per step)
    more than the floor; the timed ratios come from :func:`measure`, the shares from here.
    """
    import cProfile
    import pstats
    import time

    torch.manual_seed(0)
    base = MODELS["mlp"]()
    out: dict[str, float] = {}
    for name, builder in (("floor", floor_step), ("dpfy", dpfy_step)):
        step = builder(copy.deepcopy(base), x, y)
        for _ in range(5):
            step()
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items())
        out[f"{name}: total (profiled)"] = 1e3 * total / steps
        shared = 0.0
        for label, suffix, func in WORK:
            ms = 1e3 * sum(
                (tt if f == "~" else ct) for (f, _, fn), (_, _, tt, ct, _) in stats.items()
                if f.endswith(suffix) and fn == func
            ) / steps
            out[f"{name}: {label}"] = ms
            shared += ms
        out[f"{name}: everything else"] = 1e3 * total / steps - shared
        py = sum(nc for (f, _, _), (_, nc, _, _, _) in stats.items() if f != "~")
        out[f"{name}: Python function calls per step"] = py / steps
        if name == "dpfy":
            for label, suffix, func in PARTS:
                cum = sum(ct for (f, _, fn), (_, _, _, ct, _) in stats.items()
                          if f.endswith(suffix) and fn == func)
                out[f"dpfy part: {label}"] = 1e3 * cum / steps
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="wall time (the figure of merit) or process CPU time (steadier on a loaded machine)",
    )
    parser.add_argument("--json", default=None, help="write JSON to this path (- = stdout)")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="STEPS",
        help="also profile STEPS dpfy and floor steps (cProfile, CPU clock): where the time goes",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
    if args.profile:
        prof = profile(x, y, args.profile)
        print(f"profile of {args.profile} steps, ms per step (cumulative; CPU clock):")
        for label, ms in prof.items():
            print(f"  {label:40s} {ms:8.3f}")
    err = check_floor(x, y)
    if not err < 1e-5:
        raise SystemExit(f"the floor step disagrees with PrivateGradient: relative error {err}")
    res = measure(
        "mlp", list(BUILDERS), batch=args.batch, rounds=args.rounds, steps=args.steps,
        warmup=3, max_seconds=60.0, builders=BUILDERS,
        clock=time.perf_counter if args.clock == "wall" else time.process_time,
    )
    print(f"\nmlp (batch {args.batch}, {args.threads} threads, {args.clock} clock); floor vs "
          "PrivateGradient "
          f"(noise off): relative error {err:.1e}")
    print(f"  {'method':16s} {'median ms':>10s} {'x plain':>8s} {'IQR ms':>14s}")
    for m, r in res.items():
        iqr = f"{r['q25_ms']:.1f}-{r['q75_ms']:.1f}"
        print(f"  {m:16s} {r['median_ms']:10.2f} {r['ratio_to_plain']:8.2f} {iqr:>14s}")
    noise_ms = res["floor"]["median_ms"] - res["floor_no_noise"]["median_ms"]
    print(f"  noise inside the step: {noise_ms:.2f} ms = "
          f"{noise_ms / res['plain']['median_ms']:.2f} x plain")
    if args.json:
        report = {"batch": args.batch, "threads": args.threads, "clock": args.clock,
                  "floor_relative_error": err, "models": {"mlp": res}}
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
