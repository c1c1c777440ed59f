"""DP-SGD step time relative to a plain PyTorch step: dpfy vs Opacus 1.6, side by side.

One run times, on the same model, batch and thread count, a plain step (forward, backward,
SGD step), dpfy's ``PrivateGradient`` step (accumulate + release + SGD step, including the
ledger entries) and Opacus' modes (``hooks``, ``functorch``, ``ew``, ``ghost`` fast gradient
clipping), all with flat clipping (C = 1) and noise multiplier 1. The methods are measured in
interleaved rounds (every method once per round, in a rotating order) so that load from other
processes hits them alike; the figure of merit is the median step time divided by the plain
median (DESIGN.md section 9).

``dpfy`` is dpfy's step as a user gets it: the attribution check on, every chunk within its
5 % time budget. ``dpfy_attr`` runs the check on every chunk whatever it costs and
``dpfy_nocheck`` without it (their ratios are the check's cost). ``dpfy_bandmf``,
``dpfy_blt`` and ``dpfy_tree`` are dpfy's step with correlated DP-FTRL noise (their ratio
to ``dpfy`` is the overhead of the noise streams).

Models (``--models``; the default is the two image models at batch 256):

* ``mlp``: 784-512-256-10 on 28x28 inputs; ``cnn``: the recipes' ``gn_cnn``.
* ``mha``: a small transformer text classifier on ``nn.MultiheadAttention``: token and
  position embeddings (vocabulary 1000, width 64), 2 post-norm blocks of [4-head
  self-attention with a ``key_padding_mask``, LayerNorm, MLP 64-128-64, LayerNorm], mean
  pool over the valid tokens, linear to 2 classes.
* ``lstm``: Embedding(1000, 64) -> ``nn.LSTM(64, 128)`` (``--lstm-layers``, default 1) ->
  the output at each example's last valid token -> linear to 2 classes.

The text models run at batch 64 (unless ``--batch``) on random token ids of sequence length
64 with random lengths (uniform 16..64) and trailing padding; the model input is the tuple
``(tokens, pad)`` with ``pad`` True on padded positions (``PrivateGradient.accumulate``'s tuple
convention, ``model(*inputs)``). dpfy and plain run the torch modules; Opacus runs its own
replacements, ``opacus.layers.DPMultiheadAttention`` and ``DPLSTM``, built by
``ModuleValidator.fix`` from the same weights. A mode that cannot run a model is reported
with its error instead of a time.

Usage::

    python benchmarks/dpsgd_step.py                 # table
    python benchmarks/dpsgd_step.py --models mha lstm --json out.json
    python benchmarks/dpsgd_step.py --threads 1 --methods dpfy dpfy_bandmf dpfy_blt dpfy_tree
    python benchmarks/dpsgd_step.py --json out.json # also write JSON ("-" for stdout)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from dpfy.ledger import Ledger
from dpfy.queries import GaussianSumQuery
from dpfy.randomness import Randomness
from dpfy.sampling import SampleSpec
from dpfy.training import PrivateGradient
from dpfy.training.recipes import make_model

CLIP, Z, LR = 1.0, 1.0, 0.05


def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def make_cnn() -> nn.Module:
    """conv16-GN-pool-conv32-GN-pool-linear on 28x28x1: the recipes' ``gn_cnn``."""
    return make_model("gn_cnn")


VOCAB, SEQ_LEN, MIN_LEN, WIDTH = 1000, 64, 16, 64


class _AttentionBlock(nn.Module):
    """Post-norm transformer block: self-attention (padded keys masked) and a 64-128-64 MLP."""

    def __init__(self, dim: int = WIDTH, heads: int = 4, hidden: int = 128) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm1 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, h: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        a, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        h = self.norm1(h + a)
        return self.norm2(h + self.mlp(h))


class MHAClassifier(nn.Module):
    """Token + learned position embeddings, 2 attention blocks, masked mean pool, 2 classes."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ_LEN, WIDTH)
        self.blocks = nn.ModuleList(_AttentionBlock() for _ in range(blocks))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        # batch-first position ids, contiguous (Opacus' ghost embedding norm views them)
        pos = torch.arange(s, device=tokens.device).repeat(b, 1)
        h = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            h = block(h, pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class LSTMClassifier(nn.Module):
    """Embedding -> LSTM -> output at the last valid token -> 2 classes."""

    def __init__(self, layers: int = 1, hidden: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.tok(tokens))
        last = ((~pad).sum(1) - 1).view(-1, 1, 1).expand(-1, 1, out.shape[-1])
        return self.head(out.gather(1, last).squeeze(1))


LSTM_LAYERS = 1


def make_mha() -> nn.Module:
    return MHAClassifier()


def make_lstm() -> nn.Module:
    return LSTMClassifier(LSTM_LAYERS)


def text_batch(batch: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Random token ids [B, 64] with lengths uniform in 16..64 and trailing padding (id 0).

    Returns ``((tokens, pad), labels)``; ``pad`` is True on padded positions.
    """
    lengths = torch.randint(MIN_LEN, SEQ_LEN + 1, (batch,))
    pad = torch.arange(SEQ_LEN).unsqueeze(0) >= lengths.unsqueeze(1)
    tokens = torch.randint(1, VOCAB, (batch, SEQ_LEN)).masked_fill(pad, 0)
    return (tokens, pad), torch.randint(0, 2, (batch,))


MODELS = {"mlp": make_mlp, "cnn": make_cnn}  # the image models (other scripts iterate these)
TEXT_MODELS = {"mha": make_mha, "lstm": make_lstm}
ALL_MODELS = {**MODELS, **TEXT_MODELS}
DEFAULT_BATCH = {"mlp": 256, "cnn": 256, "mha": 64, "lstm": 64}
Step = Callable[[], None]
Inputs = torch.Tensor | tuple[torch.Tensor, ...]


def _args(x: Inputs) -> tuple[torch.Tensor, ...]:
    """The positional model arguments: ``model(x)`` for a tensor, ``model(*x)`` for a tuple."""
    return x if isinstance(x, tuple) else (x,)


def plain_step(model: nn.Module, x: Inputs, y: torch.Tensor) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    args = _args(x)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(*args), y).backward()
        opt.step()

    return step


def dpfy_step(
    model: nn.Module, x: Inputs, y: torch.Tensor, attribution_check: int | None = None
) -> Step:
    """dpfy's step as a user gets it (``attribution_check=None``: the attribution check at its
    default, every chunk within its 5 % time budget), or with the check every n-th chunk
    whatever it costs (n >= 1), or off (0)."""
    batch = _args(x)[0].shape[0]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    pg = PrivateGradient(model, GaussianSumQuery(CLIP, Z), expected_batch_size=batch)
    if attribution_check is not None:
        pg.attribution.every, pg.attribution.budget = attribution_check, None
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    ledger, rng = Ledger(), Randomness(seed=0)
    spec = SampleSpec("poisson", dataset_size=60_000, sampling_rate=batch / 60_000)

    def step() -> None:
        sid = ledger.record_sample(spec)
        pg.accumulate(x, y, loss_fn)
        pg.release(ledger=ledger, sample_id=sid, randomness=rng)
        opt.step()

    return step


def dpfy_correlated_step(
    strategy: str,
) -> Callable[[nn.Module, Inputs, torch.Tensor], Step]:
    """dpfy's step with correlated (DP-FTRL) noise instead of independent noise: the
    ``CorrelatedNoiseQuery`` of a BandMF (band 16), BLT (4 buffers) or tree plan for 1000
    steps of the cyclic order of 60,000 examples (docs/architecture.md, 5.16)."""

    def build(model: nn.Module, x: Inputs, y: torch.Tensor) -> Step:
        from dpfy.correlated import Cyclic, make_plan
        from dpfy.queries.correlated import CorrelatedNoiseQuery
        from dpfy.sampling import CyclicSampler

        batch = _args(x)[0].shape[0]
        spec = CyclicSampler(60_000, batch).sample_spec()
        period = int(spec.steps_per_epoch or 1)
        plan = make_plan(strategy, 1000, Cyclic(period), band=16, buffers=4, maxiter=50)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        query = CorrelatedNoiseQuery(plan, CLIP, Z)
        pg = PrivateGradient(model, query, expected_batch_size=batch)
        loss_fn = nn.CrossEntropyLoss(reduction="none")
        ledger, rng = Ledger(), Randomness(seed=0)

        def step() -> None:
            sid = ledger.record_sample(spec, epoch=query.steps_done // period)
            pg.accumulate(x, y, loss_fn)
            pg.release(ledger=ledger, sample_id=sid, randomness=rng)
            opt.step()

        return step

    return build


def opacus_step(mode: str) -> Callable[[nn.Module, Inputs, torch.Tensor], Step]:
    def build(model: nn.Module, x: Inputs, y: torch.Tensor) -> Step:
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator

        if any(isinstance(m, nn.MultiheadAttention | nn.LSTM) for m in model.modules()):
            # Opacus' own DPMultiheadAttention / DPLSTM, with the torch module's weights
            model = ModuleValidator.fix(model)
        args = _args(x)
        batch = args[0].shape[0]
        data = torch.utils.data.TensorDataset(
            *(t.repeat(4, *([1] * (t.dim() - 1))) for t in args), y.repeat(4)
        )
        loader = torch.utils.data.DataLoader(data, batch_size=batch)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        engine = PrivacyEngine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = engine.make_private(
                module=model,
                optimizer=opt,
                criterion=nn.CrossEntropyLoss(),
                data_loader=loader,
                noise_multiplier=Z,
                max_grad_norm=CLIP,
                poisson_sampling=False,
                grad_sample_mode=mode,
            )
        if mode == "ghost":
            gmodel, dpopt, criterion, _ = out

            def step() -> None:
                dpopt.zero_grad(set_to_none=True)
                criterion(gmodel(*args), y).backward()
                dpopt.step()

        else:
            gmodel, dpopt, _ = out
            loss_fn = nn.CrossEntropyLoss()

            def step() -> None:
                dpopt.zero_grad(set_to_none=True)
                loss_fn(gmodel(*args), y).backward()
                dpopt.step()

        return step

    return build


METHODS = {
    "plain": plain_step,
    "dpfy": dpfy_step,
    # the attribution check on every step whatever it costs, and off: with ``dpfy`` (the
    # default, within its time budget) the check's cost
    "dpfy_attr": lambda model, x, y: dpfy_step(model, x, y, attribution_check=1),
    "dpfy_nocheck": lambda model, x, y: dpfy_step(model, x, y, attribution_check=0),
    "dpfy_bandmf": dpfy_correlated_step("bandmf"),
    "dpfy_blt": dpfy_correlated_step("blt"),
    "dpfy_tree": dpfy_correlated_step("tree"),
    "opacus_hooks": opacus_step("hooks"),
    "opacus_functorch": opacus_step("functorch"),
    "opacus_ew": opacus_step("ew"),
    "opacus_ghost": opacus_step("ghost"),
}


def measure(
    model_name: str,
    methods: list[str],
    *,
    batch: int,
    rounds: int,
    steps: int,
    warmup: int,
    max_seconds: float,
    clock: Callable[[], float] = time.perf_counter,
    builders: dict[str, Callable[[nn.Module, Inputs, torch.Tensor], Step]] | None = None,
) -> dict[str, dict]:
    """Median step time of each method, measured in interleaved rounds.

    ``builders`` maps method names to step builders (default: this script's ``METHODS``).
    """
    builders = METHODS if builders is None else builders
    torch.manual_seed(0)
    base = ALL_MODELS[model_name]()
    x: Inputs
    if model_name in TEXT_MODELS:
        x, y = text_batch(batch)
    else:
        x = torch.randn(batch, 1, 28, 28)
        y = torch.randint(0, 10, (batch,))
    steps_fn: dict[str, Step] = {}
    errors: dict[str, str] = {}
    for m in methods:
        try:
            steps_fn[m] = builders[m](copy.deepcopy(base), x, y)
            for _ in range(warmup):
                steps_fn[m]()
        except Exception as exc:  # a peer mode that cannot run this model is reported
            errors[m] = f"{type(exc).__name__}: {exc}"[:200]
            steps_fn.pop(m, None)
    times: dict[str, list[float]] = {m: [] for m in steps_fn}
    budget: dict[str, float] = dict.fromkeys(steps_fn, 0.0)
    order = list(steps_fn)
    for r in range(rounds):
        rot = order[r % len(order) :] + order[: r % len(order)]
        for m in rot:
            if budget[m] > max_seconds and len(times[m]) >= 3:
                continue  # very slow mode: enough samples for a median
            if m in errors:
                continue
            for _ in range(steps):
                t0 = clock()
                try:
                    steps_fn[m]()
                except Exception as exc:  # a mode that fails after its warm-up is reported
                    errors[m] = f"{type(exc).__name__} (timed step): {exc}"[:200]
                    break
                dt = clock() - t0
                times[m].append(dt)
                budget[m] += dt
    plain = statistics.median(times["plain"]) if "plain" in times else float("nan")
    result: dict[str, dict] = {}
    for m in methods:
        if m in errors:
            result[m] = {"error": errors[m]}
            continue
        med = statistics.median(times[m])
        result[m] = {
            "median_ms": 1e3 * med,
            "ratio_to_plain": med / plain,
            "samples": len(times[m]),
            "q25_ms": 1e3 * statistics.quantiles(times[m], n=4)[0],
            "q75_ms": 1e3 * statistics.quantiles(times[m], n=4)[2],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(ALL_MODELS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--batch", type=int, default=None, help="batch size (default: 256 image, 64 text)"
    )
    parser.add_argument("--lstm-layers", type=int, default=1, help="LSTM layers of 'lstm'")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=2, help="steps per method per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--max-seconds", type=float, default=20.0, help="time budget per slow method and model"
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time (the figure of merit) or process CPU time (steadier on a loaded machine)",
    )
    parser.add_argument("--json", default=None, help="write JSON to this path (- = stdout)")
    args = parser.parse_args(argv)
    global LSTM_LAYERS
    LSTM_LAYERS = args.lstm_layers
    torch.set_num_threads(args.threads)
    methods = list(dict.fromkeys(["plain", *args.methods]))
    batches = {name: args.batch or DEFAULT_BATCH[name] for name in args.models}
    report: dict = {
        "torch": torch.__version__,
        "threads": args.threads,
        "clock": args.clock,
        "batch": batches[args.models[0]] if len(set(batches.values())) == 1 else batches,
        "clip_norm": CLIP,
        "noise_multiplier": Z,
        "models": {},
    }
    try:
        import opacus

        report["opacus"] = opacus.__version__
    except ImportError:
        report["opacus"] = None
    if "lstm" in args.models:
        report["lstm_layers"] = args.lstm_layers
    for name in args.models:
        res = measure(
            name, methods, batch=batches[name], rounds=args.rounds, steps=args.steps,
            warmup=args.warmup, max_seconds=args.max_seconds,
            clock=time.perf_counter if args.clock == "wall" else time.process_time,
        )
        report["models"][name] = res
        print(f"\n{name} (batch {batches[name]}, {args.threads} threads, {args.clock} clock)")
        print(f"  {'method':18s} {'median ms':>10s} {'x plain':>8s} {'IQR ms':>16s} {'n':>4s}")
        for m, r in res.items():
            if "error" in r:
                print(f"  {m:18s} error: {r['error']}")
                continue
            iqr = f"{r['q25_ms']:.1f}-{r['q75_ms']:.1f}"
            print(
                f"  {m:18s} {r['median_ms']:10.2f} {r['ratio_to_plain']:8.2f} {iqr:>16s} "
                f"{r['samples']:4d}"
            )
        vs = versus_best_opacus(res)
        if vs is not None:
            report.setdefault("dpfy_vs_best_opacus", {})[name] = vs
            print(f"  dpfy / best Opacus mode ({vs['best_opacus']}): {vs['ratio']:.2f}")
    if args.json:
        write_json(report, args.json)
    return 0


def versus_best_opacus(res: dict[str, dict]) -> dict | None:
    """dpfy's median over the fastest Opacus mode's that ran (``None``: either is missing)."""
    ran = {m: r for m, r in res.items() if m.startswith("opacus_") and "median_ms" in r}
    if "median_ms" not in res.get("dpfy", {}) or not ran:
        return None
    best = min(ran, key=lambda m: ran[m]["median_ms"])
    return {"best_opacus": best, "ratio": res["dpfy"]["median_ms"] / ran[best]["median_ms"]}


def write_json(report: dict, dest: str) -> None:
    """Write ``report`` as indented JSON to the file ``dest`` ("-" = stdout)."""
    text = json.dumps(report, indent=2)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
