"""DP-SGD step time and peak device memory on a GPU: plain vs dpfy vs Opacus, side by side.

Rows, in priority order (the run stops starting rows once ``--seconds`` are spent):

1. ``minilm-full``, ``minilm-lora``: a MiniLM-L6-shaped BERT classifier (6 layers, width 384),
   batch 32, seq 128, fp32;
2. ``gpt2s-full``, ``gpt2s-lora``: a GPT-2-small-shaped LM (12 layers, width 768, tied
   embeddings), batch 32, seq 256, bf16 autocast over fp32 master weights; the full row also
   times dpfy with secure noise (``dpfy_secure``) and the noise alone for its 124M parameters:
   dpfy's seeded device generator (Philox4x32-10 in torch ops), dpfy's secure generator
   (AES-256-CTR keystream on the host, copied) and torch's native device generator;
3. ``llama1b-lora``: a Llama-shaped model of about 1.1B parameters (22 layers, width 2048,
   grouped-query attention), LoRA r=8 on q/v, frozen base in bf16, batch 8, seq 256.

Weights are random from a ``transformers`` config (no network, nothing to download): step time
does not depend on their values. LoRA is r=8, alpha 16 (Hu et al. 2022). Methods: ``plain``
(forward, backward, SGD), ``dpfy`` (``PrivateGradient``, Gaussian noise, the ledger),
``opacus_ghost`` and ``opacus_hooks`` (Opacus 1.6 ``make_private``); a method that fails is
reported with its error. Time: interleaved rounds (every method once per round, rotating
order), each step closed by ``torch.cuda.synchronize``; the ratio is the median over rounds of
the same-round ratio to plain. Memory: ``torch.cuda.max_memory_allocated`` during one step
minus the memory allocated before it (the step's own peak; the models of the other methods
stay resident and are not counted).

``--tiny --device cpu`` runs every row with tiny shapes on the CPU (what the test does).

Usage (on the GPU machine: ``benchmarks/gpu/speed.sh``)::

    python benchmarks/gpu_speed.py --device cuda --json $OUT/gpu_speed.json
    python benchmarks/gpu_speed.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from dpfy.ledger import Ledger  # noqa: E402
from dpfy.queries import GaussianSumQuery  # noqa: E402
from dpfy.randomness import Randomness  # noqa: E402
from dpfy.sampling import SampleSpec  # noqa: E402
from dpfy.training import PrivateGradient  # noqa: E402
from dpfy.training.losses import causal_lm_loss, sequence_classification_loss  # noqa: E402

CLIP, Z, LR = 1.0, 1.0, 1e-3
Step = Callable[[], None]
METHODS = ("plain", "dpfy", "opacus_ghost", "opacus_hooks")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    family: str  # minilm, gpt2s, llama1b
    variant: str  # full, lora
    batch: int
    seq: int
    bf16: bool
    methods: tuple[str, ...] = METHODS


ROWS = (
    Row("minilm-full", "minilm", "full", 32, 128, False),
    Row("minilm-lora", "minilm", "lora", 32, 128, False),
    Row("gpt2s-full", "gpt2s", "full", 32, 256, True, METHODS + ("dpfy_secure",)),
    Row("gpt2s-lora", "gpt2s", "lora", 32, 256, True),
    Row("llama1b-lora", "llama1b", "lora", 8, 256, True),
)
TINY_SHAPE = (4, 16)


def config(family: str, tiny: bool, seq: int) -> Any:
    import transformers

    if family == "minilm":
        size = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, vocab_size=128) if tiny else dict(
            hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
            intermediate_size=1536, vocab_size=30522)
        return transformers.BertConfig(**size, num_labels=2, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)
    if family == "gpt2s":
        size = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128) if tiny else dict(
            n_layer=12, n_embd=768, n_head=12, vocab_size=50257)
        return transformers.GPT2Config(**size, n_positions=seq, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0)
    size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=128) if tiny else dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
    return transformers.LlamaConfig(**size, max_position_embeddings=seq)


def make_model(row: Row, tiny: bool, device: str) -> tuple[nn.Module, Callable]:
    """The row's model in training mode on ``device`` (random weights) and its per-example loss."""
    import transformers

    seq = TINY_SHAPE[1] if tiny else row.seq
    cfg = config(row.family, tiny, seq)
    torch.manual_seed(0)
    # built on the device: the random initialisation of ~1.1B weights runs there, not on one
    # host thread
    with torch.device(device):
        if row.family == "minilm":
            model: nn.Module = transformers.BertForSequenceClassification(cfg)
            loss, targets, task = sequence_classification_loss, ["query", "value"], "SEQ_CLS"
        elif row.family == "gpt2s":
            model = transformers.GPT2LMHeadModel(cfg)
            loss, targets, task = causal_lm_loss, ["c_attn"], "CAUSAL_LM"
        else:
            model = transformers.LlamaForCausalLM(cfg)
            loss, targets, task = causal_lm_loss, ["q_proj", "v_proj"], "CAUSAL_LM"
    if row.variant == "lora":
        import peft

        if row.bf16:  # the frozen base in bf16; the LoRA factors stay fp32 (master weights)
            model = model.to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, task_type=task))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    model.train()  # dropout is 0 everywhere; Opacus needs training mode
    return model.to(device), loss


def make_batch(row: Row, model: nn.Module, tiny: bool, device: str) -> tuple[dict, torch.Tensor]:
    """Random ids with some padding; explicit [B, T] position (and token-type) ids for every
    method (Opacus's embedding rules need them per example; see transformer_step.py)."""
    b, t = TINY_SHAPE if tiny else (row.batch, row.seq)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[b // 2 :, 3 * t // 4 :] = 0
    x = {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(t).repeat(b, 1)}
    if row.family == "minilm":
        x["token_type_ids"] = torch.zeros(b, t, dtype=torch.long)
        y = torch.randint(0, 2, (b,), generator=g)
    else:
        y = ids.masked_fill(mask == 0, -100)
    return {k: v.to(device) for k, v in x.items()}, y.to(device)


class _PerExample(nn.Module):
    """Loss module for Opacus: per-example losses, reduced as its ``reduction`` says."""

    def __init__(self, loss: Callable) -> None:
        super().__init__()
        self.loss, self.reduction = loss, "mean"

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per: torch.Tensor = self.loss(logits.float(), y)
        if self.reduction == "none":
            return per
        return per.mean() if self.reduction == "mean" else per.sum()


def build(method: str, model: nn.Module, loss: Callable, x: dict, y: torch.Tensor,
          bf16: bool) -> Step:
    """One training step of ``method``; every step ends with its gradients freed."""
    device = y.device.type
    cast = (lambda: torch.autocast(device, torch.bfloat16)) if bf16 else nullcontext
    params = [p for p in model.parameters() if p.requires_grad]
    batch = y.shape[0]
    opt = torch.optim.SGD(params, lr=LR)
    if method == "plain":

        def plain() -> None:
            with cast():
                out = model(**x)
            loss(out.logits.float(), y).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return plain
    if method.startswith("dpfy"):
        pg = PrivateGradient(model, GaussianSumQuery(CLIP, Z), expected_batch_size=batch,
                             precision="bf16" if bf16 else "fp32")
        ledger = Ledger()
        rng = Randomness(secure=True) if method == "dpfy_secure" else Randomness(seed=0)
        spec = SampleSpec("poisson", dataset_size=100_000, sampling_rate=batch / 100_000)

        def private() -> None:
            sid = ledger.record_sample(spec)
            pg.accumulate(x, y, lambda out, t: loss(out.logits.float(), t))
            pg.release(ledger=ledger, sample_id=sid, randomness=rng)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return private
    from opacus import PrivacyEngine

    mode = method.removeprefix("opacus_")
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x["input_ids"].cpu(), y.cpu()), batch_size=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = PrivacyEngine().make_private(
            module=model, optimizer=opt, criterion=_PerExample(loss), data_loader=loader,
            noise_multiplier=Z, max_grad_norm=CLIP, poisson_sampling=False,
            grad_sample_mode=mode)
    gmodel, dpopt = out[0], out[1]
    crit = out[2] if mode == "ghost" else _PerExample(loss)

    def opacus() -> None:
        with cast():
            logits = gmodel(**x).logits
        crit(logits, y).backward()
        dpopt.step()
        dpopt.zero_grad(set_to_none=True)

    return opacus


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_memory_mb(step: Step, device: str) -> float:
    """Peak device memory of one step above what was allocated before it (MB); nan on CPU."""
    if device != "cuda":
        return float("nan")
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    _sync(device)
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def run_row(row: Row, args: argparse.Namespace, deadline: float) -> dict:
    """Interleaved timing and per-step memory of the row's methods."""
    dev = args.device
    base, loss = make_model(row, args.tiny, dev)
    x, y = make_batch(row, base, args.tiny, dev)
    res: dict[str, Any] = {"trainable": sum(p.numel() for p in base.parameters()
                                            if p.requires_grad)}
    steps: dict[str, Step] = {}
    for m in [m for m in row.methods if m in args.methods or m == "dpfy_secure"]:
        try:
            steps[m] = build(m, copy.deepcopy(base), loss, x, y, row.bf16)
            for _ in range(args.warmup):
                steps[m]()
            res[m] = {"step_mb": step_memory_mb(steps[m], dev)}
        except Exception as exc:  # a mode that cannot run this model is reported
            res[m] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            steps.pop(m, None)
            if dev == "cuda":
                torch.cuda.empty_cache()
    del base
    times: dict[str, list[float]] = {m: [] for m in steps}
    order = list(steps)
    for r in range(args.rounds):
        if r >= 2 and time.perf_counter() > deadline:
            break
        for m in order[r % len(order):] + order[: r % len(order)]:
            _sync(dev)
            t0 = time.perf_counter()
            steps[m]()
            _sync(dev)
            times[m].append(time.perf_counter() - t0)
    for m, ts in times.items():
        if not ts:
            continue
        ratios = [a / b for a, b in zip(ts, times.get("plain", []), strict=False)]
        res[m].update(median_ms=1e3 * statistics.median(ts), rounds=len(ts),
                      ratio=statistics.median(ratios) if ratios else float("nan"))
    if row.name == "gpt2s-full":
        res["noise_alone_ms"] = noise_alone(res["trainable"], dev, args.rounds)
    return res


def noise_alone(n: int, device: str, rounds: int) -> dict[str, float]:
    """Median ms of N(0, 1) noise added to ``n`` float32 values on ``device``: dpfy seeded
    (device Philox), dpfy secure (host keystream, copied) and torch's native generator."""
    acc = torch.zeros(n, device=device)
    out = torch.empty_like(acc)
    seeded, secure = Randomness(seed=0), Randomness(secure=True)
    draws: dict[str, Step] = {
        "dpfy_seeded": lambda: seeded.normal_([out], [1.0], add=[acc]),
        "dpfy_secure": lambda: secure.normal_([out], [1.0], add=[acc]),
        "torch_native": lambda: torch.add(acc, torch.randn_like(acc), out=out),
    }
    failed: dict[str, Any] = {}
    for k in list(draws):
        try:
            draws[k]()
        except Exception as exc:  # e.g. no cryptography package for the secure generator
            failed[k] = f"{type(exc).__name__}: {exc}"[:200]
            del draws[k]
    times: dict[str, list[float]] = {k: [] for k in draws}
    for r in range(max(3, rounds)):
        for k, draw in draws.items():
            _sync(device)
            t0 = time.perf_counter()
            draw()
            _sync(device)
            if r:  # the first round warms up
                times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()} | failed


def report(row: Row, res: dict) -> None:
    print(f"\n{row.name} ({res['trainable']:,} trainable parameters)", flush=True)
    print(f"  {'method':13s} {'median ms':>10s} {'x plain':>8s} {'step MB':>9s} {'x plain':>8s}")
    plain_mb = res.get("plain", {}).get("step_mb")
    for m in row.methods:
        r = res.get(m)
        if r is None:
            continue
        if "error" in r:
            print(f"  {m:13s} {r['error']}")
            continue
        mb = r["step_mb"]
        rel = f"{mb / plain_mb:8.2f}" if plain_mb and mb == mb else f"{'-':>8s}"
        print(f"  {m:13s} {r.get('median_ms', float('nan')):10.2f}"
              f" {r.get('ratio', float('nan')):8.2f} {mb:9.0f} {rel}")
    for k, v in res.get("noise_alone_ms", {}).items():
        print(f"  noise alone, {k:13s} " + (f"{v:8.2f} ms" if isinstance(v, float) else v))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    parser.add_argument("--rows", nargs="+", default=[r.name for r in ROWS],
                        choices=[r.name for r in ROWS])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=330.0,
                        help="no row starts after this, and a row's rounds stop at its share")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Full backward hook")  # Opacus's, every step
    start = time.perf_counter()
    rows = [r for r in ROWS if r.name in args.rows]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {gpu}, rounds {args.rounds}, warm-up {args.warmup}")
    results: dict[str, Any] = {"device": gpu, "torch": torch.__version__, "tiny": args.tiny}
    for i, row in enumerate(rows):
        spent = time.perf_counter() - start
        if spent > args.seconds:
            results[row.name] = {"skipped": f"time budget spent ({spent:.0f} s)"}
            print(f"\n{row.name}: skipped, time budget spent")
            continue
        share = (args.seconds - spent) / (len(rows) - i)
        try:
            results[row.name] = res = run_row(row, args, time.perf_counter() + share)
            report(row, res)
        except Exception as exc:  # a row that cannot be built is reported, the rest run
            results[row.name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"\n{row.name}: {results[row.name]['error']}")
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
