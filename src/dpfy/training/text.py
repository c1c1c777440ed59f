"""Ready-made DP fine-tuning of a pretrained text encoder (what ``dpfy train rotten-tomatoes``
calls).

:func:`train_text_classifier` fine-tunes all-MiniLM-L6-v2 (:mod:`dpfy.models.pretrained`) as a
binary fresh/rotten classifier on the rotten-tomatoes snippets (:func:`dpfy.datasets.
rotten_tomatoes`, split by movie), with DP-Adam: the :class:`~dpfy.training.PrivateTrainer`
releases the clipped, noised gradient sum (the noise multiplier calibrated to the target
(epsilon, delta) from the sampler's event), and Adam (Kingma & Ba 2015) post-processes it, as in
Li et al. 2022 ("Large language models can be strong differentially private learners").

Unit of privacy: one training snippet (add-or-remove for Poisson sampling). A movie contributes
2 to 35 snippets, so the guarantee per *movie* is weaker (group privacy); the report states the
snippet unit. With ``unit="movie"`` the unit is one movie instead (user-level DP,
:mod:`dpfy.training.users`): the sampler draws movies (N = 429 in the train split), each
movie's snippet gradients are summed (or averaged) and clipped as one vector, optionally
capped at ``max_examples_per_user`` snippets per movie; ``batch_size`` is then the expected
number of movies per batch (default: at most N // 8, :func:`dpfy.training.users.
recipe_batch_size`), checked against the movies before the tokenizer and model load.

Fine-tuning modes (``lora``):

The model is the pretrained encoder with a zero-initialised 2-way linear head on the masked
mean of its last hidden states (:class:`dpfy.models.heads.MeanPooledClassifier`): the pooling the
sentence encoder was trained with, and no fresh pooler (a fresh 384 x 384 ``[CLS]`` pooler, as
in ``BertForSequenceClassification``, made DP-Adam at epsilon 8 collapse to one class).

* full (default): every parameter of the encoder and the head is trainable (22.7M
  parameters); defaults lr 1e-4, 2 epochs;
* LoRA (Hu et al. 2022, via ``peft``): rank r=8 (alpha 16, no LoRA dropout) on the attention
  ``query`` and ``value`` projections of all 6 layers, plus the head trained in full; the
  pretrained weights stay frozen (about 75k trainable parameters); defaults lr 5e-4, 3
  epochs.

* bias-only (``bias_only``; DP-BiTFiT, Bu et al. 2022): only the encoder's biases (about 26k
  parameters) and the head are trainable; defaults lr 5e-3, 3 epochs, joint clipping;
* LoRA's rank (``lora_rank``, alpha twice the rank) and targets (``lora_targets``:
  ``"attention"``, query and value; ``"all-linear"``, every linear layer of the encoder).

Any mode can start from a DP linear probe (``linear_probe``, LP-FT; :mod:`dpfy.training.lpft`:
the probe's releases lead the run's one ledger and the fine-tuning's noise is calibrated so
that the ledger of both meets the target) and warm Adam's rates up linearly (``warmup``, a
fraction of the steps; :class:`LinearWarmUp`) with its own epsilon (``adam_eps``).

Full fine-tuning clips the head and the encoder as two groups (C / sqrt 2 each, the noise and
privacy event of joint clipping to C; :func:`dpfy.queries.nested.separate_clipping`): once the head
has grown (weights of std 0.1), the encoder holds about 97 % of a snippet's squared gradient
norm (median over 32 snippets; LoRA factors: 18 %), so joint clipping scales the head's signal
down about 18-fold under the same noise, and DP full fine-tuning reached 71.2 % at epsilon 8
where LoRA reached 75.9 % (benchmarks/results/sentiment/).

Both: expected batch size 256 (Poisson rate 256 / N), clip norm 1.0, Adam betas (0.9, 0.999),
no weight EMA. Snippets are tokenised once with MiniLM's uncased WordPiece tokenizer, padded and
truncated to ``max_length`` tokens: at the default 64, 7 of the 12,808 snippets (0.05 %) are
cut; at 48, 3.9 %; at 32, 30.3 % (:func:`truncated_fraction`; read from the private snippets,
so a private diagnostic, never in the ledger). The training snippets are ordered by length and
every physical chunk is cut to its longest snippet
(:func:`trim_padding`, exact): about half the tokens of a padded batch, and about half the time
of a step. A chunk's run time then depends on its longest snippet; what is released (the model,
the ledger) does not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from dpfy import datasets
from dpfy._validate import check_int, check_range
from dpfy.config import LORA_TARGETS, TEXT_DATASETS, TEXT_MODELS, RunConfig
from dpfy.ledger import Ledger
from dpfy.models.modes import evaluating
from dpfy.training import users
from dpfy.training.budget import spent
from dpfy.training.devices import host_copy
from dpfy.training.history import ProgressInfo
from dpfy.training.losses import sequence_classification_loss
from dpfy.training.skeleton import (
    Optimisation,
    Recipe,
    RecipeData,
    RunHooks,
    TrainResultSummary,
    run_recipe,
)
from dpfy.training.trainer import PrivateTrainer, TrainerOptions

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dpfy.randomness import Randomness
    from dpfy.sampling import Sampler


#: LoRA rank when ``lora_rank`` is not given; alpha is always twice the rank (scale 2).
LORA_RANK = 8
#: Defaults per mode: learning rate (Adam) and epochs; batch size and clip norm are shared.
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "full": {"learning_rate": 1e-4, "head_learning_rate": 1e-2, "epochs": 2,
             "batch_size": 256, "clip_norm": 1.0, "clip_head_separately": True},
    "lora": {"learning_rate": 5e-4, "head_learning_rate": 1e-2, "epochs": 3,
             "batch_size": 256, "clip_norm": 1.0, "clip_head_separately": False},
    # Bu et al. 2022 (DP-BiTFiT) train the biases with rates about ten times full fine-tuning's
    "bitfit": {"learning_rate": 5e-3, "head_learning_rate": 1e-2, "epochs": 3,
               "batch_size": 256, "clip_norm": 1.0, "clip_head_separately": False},
}


def text_mode(config: RunConfig) -> str:
    """The fine-tuning mode of a text run: ``"lora"``, ``"bitfit"`` or ``"full"``."""
    return "lora" if config.lora else "bitfit" if config.bias_only else "full"


def text_model_name(config: RunConfig) -> str:
    """The model's name in the ledger: base model, mode, LoRA rank and targets, LP-FT."""
    name = config.model or "minilm"
    if config.lora:
        rank = LORA_RANK if config.lora_rank is None else config.lora_rank
        name += "-lora" if (rank, config.lora_targets) == (LORA_RANK, "attention") else (
            f"-lora-r{rank}-{config.lora_targets}")
    elif config.bias_only:
        name += "-bitfit"
    return name + ("-lpft" if config.linear_probe is not None else "")


class LinearWarmUp:
    """A progress callback that raises every parameter group's rate linearly from
    ``base / steps`` to ``base`` over the first ``steps`` steps, then keeps it (Adam with
    warm-up, as Li et al. 2022 fine-tune under DP).

    The rates are set at construction for the first step and after each step for the next
    (``ProgressInfo.step`` = steps done); post-processing of released gradients, no privacy
    cost.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        check_int("steps", steps)
        self.optimizer, self.steps = optimizer, int(steps)
        self.base = [float(g["lr"]) for g in optimizer.param_groups]
        self._set(0)

    def _set(self, done: int) -> None:
        factor = min(1.0, (done + 1) / self.steps)
        for group, base in zip(self.optimizer.param_groups, self.base, strict=True):
            group["lr"] = base * factor

    def __call__(self, info: ProgressInfo) -> None:
        if info.kind == "step":
            self._set(int(info.step))


class TokenDataset(Dataset[dict[str, torch.Tensor]]):
    """Tokenised snippets as a map-style dataset of token dicts (one item = one unit).

    Items: ``input_ids``, ``token_type_ids``, ``attention_mask`` (int64, length
    ``max_length``) and ``labels`` (int64 scalar).
    """

    def __init__(self, tokens: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        self.tokens = tokens
        self.labels = labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {k: v[i] for k, v in self.tokens.items()}
        item["labels"] = self.labels[i]
        return item


    def lengths(self) -> torch.Tensor:
        """Tokens per item (incl. [CLS] and [SEP]): the sums of the attention masks."""
        return self.tokens["attention_mask"].sum(1)

    def reordered(self, order: np.ndarray | torch.Tensor) -> TokenDataset:
        """The items in ``order`` (indices into this dataset)."""
        rows = torch.as_tensor(np.asarray(order), dtype=torch.long)
        return TokenDataset({k: v[rows] for k, v in self.tokens.items()}, self.labels[rows])


def trim_padding(tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cut the token columns that are padding in every row of a batch.

    Exact for the encoders here: a padded position is masked out as an attention key and in
    the mean pooling, so no real token's output, and no gradient, depends on it (its output
    gradients are zero, so it adds nothing to any per-example norm or clipped sum either).
    Padding is on the right (``tokenize``), so the kept columns are the first
    ``max(attention_mask.sum(1))``. Tensors without a sequence axis (``labels``) are kept.
    """
    mask = tokens.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return tokens
    width = max(int(mask.sum(1).max()), 1)
    if width == mask.shape[1]:
        return tokens
    return {k: v[:, :width] if v.dim() == 2 and v.shape[1] == mask.shape[1] else v
            for k, v in tokens.items()}


def collate_trimmed(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``default_collate`` of :class:`TokenDataset` items, then :func:`trim_padding`."""
    return trim_padding(default_collate(items))


def tokenize(
    texts: Sequence[str],
    labels: np.ndarray,
    max_length: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> TokenDataset:
    """Tokenise ``texts`` padded and truncated to ``max_length`` tokens (incl. [CLS], [SEP])."""
    check_int("max_length", max_length, 2, 512)
    if tokenizer is None:
        from dpfy.models.pretrained import load_minilm_tokenizer

        tokenizer = load_minilm_tokenizer()
    enc = tokenizer(list(texts), padding="max_length", truncation=True,
                    max_length=max_length, return_tensors="pt")
    tokens = {k: enc[k].long() for k in ("input_ids", "token_type_ids", "attention_mask")}
    return TokenDataset(tokens, torch.as_tensor(np.asarray(labels), dtype=torch.long))


def truncated_fraction(
    texts: Sequence[str], max_length: int, tokenizer: PreTrainedTokenizerBase | None = None
) -> float:
    """Fraction of ``texts`` longer than ``max_length`` tokens (incl. [CLS] and [SEP])."""
    check_int("max_length", max_length, 2, 512)
    if tokenizer is None:
        from dpfy.models.pretrained import load_minilm_tokenizer

        tokenizer = load_minilm_tokenizer()
    lengths = [len(ids) for ids in tokenizer(list(texts))["input_ids"]]
    return float(np.mean(np.asarray(lengths) > max_length)) if lengths else 0.0


def make_text_model(
    model: str = "minilm",
    *,
    lora: bool = False,
    lora_rank: int = LORA_RANK,
    lora_targets: str = "attention",
    bias_only: bool = False,
) -> nn.Module:
    """The pretrained encoder with a zero-initialised 2-way head on its mean-pooled tokens
    (:class:`dpfy.models.heads.MeanPooledClassifier`): fully trainable, with LoRA of rank
    ``lora_rank`` (alpha ``2 lora_rank``) on the modules of ``LORA_TARGETS[lora_targets]``, or
    with only the encoder's biases (and the head) trainable (``bias_only``: DP-BiTFiT, Bu et
    al. 2022, about 26k encoder parameters; module docstring)."""
    if lora and bias_only:
        raise ValueError("lora and bias_only are two modes: choose one, got both")
    if lora_targets not in LORA_TARGETS:
        raise ValueError(f"lora_targets must be one of {{{', '.join(LORA_TARGETS)}}}, got "
                         f"lora_targets={lora_targets!r}")
    check_int("lora_rank", lora_rank, 1, 384)
    if model not in TEXT_MODELS:
        raise ValueError(f"model must be one of {{{', '.join(TEXT_MODELS)}}}, got model={model!r}")
    from dpfy.models.heads import MeanPooledClassifier
    from dpfy.models.pretrained import load_minilm_encoder

    # dropout off in every mode: the encoder trains as it was pretrained to be used (a
    # per-example gradient under dropout is also one the attribution check cannot recompute)
    base = load_minilm_encoder(add_pooling_layer=False, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
    width = int(base.config.hidden_size)
    encoder: nn.Module = base
    if lora:
        import peft

        cfg = peft.LoraConfig(
            r=int(lora_rank), lora_alpha=2 * int(lora_rank), lora_dropout=0.0,
            target_modules=list(LORA_TARGETS[lora_targets]),
        )
        encoder = peft.get_peft_model(encoder, cfg)
    elif bias_only:
        for name, p in encoder.named_parameters():
            p.requires_grad_(name.endswith(".bias"))
    return MeanPooledClassifier(encoder, width, num_labels=2)


def text_optimizer(
    net: nn.Module, learning_rate: float, head_learning_rate: float, eps: float = 1e-8
) -> torch.optim.Adam:
    """Adam over the trainable parameters: ``head_learning_rate`` for the zero-initialised head
    (``head.*``), ``learning_rate`` for the encoder (or its LoRA factors).

    The head starts at zero and must grow to logits of order one within a few dozen steps, the
    pretrained encoder must only be nudged: with one rate of 5e-4 for both, the head of a DP
    run stayed near zero and the model predicted one class (frozen-embedding probe, epsilon 8,
    42 steps: 51.6 % at 5e-4, 73.4 % at 1e-2 on the head).
    """
    head: list[nn.Parameter] = []
    body: list[nn.Parameter] = []
    for name, p in net.named_parameters():
        if p.requires_grad:
            (head if name.startswith("head.") else body).append(p)
    groups = [{"params": head, "lr": head_learning_rate}]
    if body:
        groups.append({"params": body, "lr": learning_rate})
    return torch.optim.Adam(groups, lr=learning_rate, eps=eps)


@torch.no_grad()
def evaluate_text(model: nn.Module, data: TokenDataset, batch_size: int = 128) -> float:
    """Accuracy of ``model`` on ``data`` (eval mode; the mode is restored)."""
    device = next(model.parameters()).device
    correct = 0
    with evaluating(model):
        for i in range(0, len(data), batch_size):
            batch = trim_padding({k: v[i : i + batch_size].to(device)
                                  for k, v in data.tokens.items()})
            logits = model(**batch).logits
            correct += int((logits.argmax(1).cpu() == data.labels[i : i + batch_size]).sum())
    return correct / max(len(data), 1)


class _TextTrainer(PrivateTrainer):
    """The trainer with test accuracy on a :class:`TokenDataset` (per epoch, in its history)."""

    def __init__(self, *args: Any, test_tokens: TokenDataset, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.test_tokens = test_tokens

    def evaluate(self, model: nn.Module | None = None, batch_size: int = 128) -> float:
        return evaluate_text(model if model is not None else self.released_model,
                             self.test_tokens, batch_size)


class _UserTextTrainer(users.UserLevelTrainer, _TextTrainer):
    """The text trainer with a movie (or any group) as the unit of privacy."""


class _RunningEpsilon:
    """The run's progress (a rich bar on a terminal, else a plain line about every 30 s:
    :mod:`dpfy.training.progress`) whose epsilon is the ledger's so far, refreshed about 50
    times a run with PLD or RDP, else after every epoch (read through
    :func:`dpfy.training.budget.spent` or the trainer's epoch record, never computed here)."""

    def __init__(self, ledger: Callable[[], Ledger], delta: float, method: str, total: int):
        from dpfy.training.progress import progress_display

        self._ledger, self._delta, self._method = ledger, delta, method
        self._every = max(1, total // 50)
        # between epochs only with the fast accountants (Monte Carlo is refreshed per epoch)
        self._per_step = method in ("pld", "rdp")
        self._display = progress_display("DP fine-tuning", total, fields=("loss", "test", "eps"))

    def __call__(self, info: ProgressInfo) -> None:
        fields: dict[str, str] = {}
        if not np.isnan(info.loss):
            fields["loss"] = f"{info.loss:.3f}"
        if info.test_accuracy is not None:
            fields["test"] = f"{info.test_accuracy:.4f}"
        if info.kind == "epoch" and info.epsilon is not None:  # the trainer's, from the ledger
            fields["eps"] = f"{info.epsilon:.3f}"
        elif self._per_step and info.step % self._every == 0:
            eps = spent(self._ledger(), self._delta, self._method)
            fields["eps"] = f"{eps:.3f}"
        self._display.update(info.step, info.epoch, **fields)

    def close(self) -> None:
        self._display.close()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TextRecipe:
    """The text recipe's own knobs (beyond :class:`dpfy.config.RunConfig`).

    Attributes:
      head_learning_rate: Adam's rate for the head (None: :data:`TEXT_DEFAULTS`, 1e-2); the
        RunConfig's ``learning_rate`` is the encoder's (:func:`text_optimizer`).
      max_physical_batch_size: rows per forward/backward pass (memory bound); None: 64 on
        the CPU, 256 on a CUDA device (the whole expected batch in one or two passes).
      accounting: accountant of calibration, guard and statement (default: the sampler's).
      clip_head_separately: clip the head and the encoder (or its LoRA factors) as two groups
        at the privacy cost of one clip norm (:func:`dpfy.queries.nested.separate_clipping`); None:
        :data:`TEXT_DEFAULTS` (full fine-tuning yes, LoRA no; module docstring).
    """

    head_learning_rate: float | None = None
    max_physical_batch_size: int | None = None
    accounting: str | None = None
    clip_head_separately: bool | None = None


def train_text_classifier(
    config: RunConfig,
    recipe: TextRecipe | None = None,
    hooks: RunHooks | None = None,
) -> TrainResultSummary:
    """DP fine-tuning of MiniLM on the rotten-tomatoes snippets; write model and ledger.

    Args:
      config: the run (:class:`dpfy.config.RunConfig`): ``dataset`` (``"rotten-tomatoes"``),
        ``model`` (``"minilm"``), ``lora`` (LoRA instead of full fine-tuning; module
        docstring), the budget, the sampler, ``epochs``/``batch_size``/``learning_rate``/
        ``clip_norm`` (None: :data:`TEXT_DEFAULTS`), ``max_length`` (tokens per snippet,
        default 64), ``seed`` (None: secure sampling and noise, a DP release; an int: a
        seeded experiment, NOT a DP release), limits, threads, precision, ``unit``
        (``"example"``: one snippet; ``"movie"``: all of one movie's snippets, with ``cap``
        and ``user_reduction``), and ``out`` (``model.pt`` -- full: the state dict; LoRA: the
        trainable tensors only --, ``ledger.jsonl``, ``summary.json``).
      recipe: the recipe's own knobs (:class:`TextRecipe`).
      hooks: ``progress`` (a bar with the ledger's epsilon so far), ``callbacks`` and
        ``batch_plan`` (:class:`dpfy.training.skeleton.RunHooks`; the others are for the
        image recipe).
    """
    if config.dataset not in TEXT_DATASETS:
        raise ValueError(f"dataset must be one of {{{', '.join(TEXT_DATASETS)}}}, got "
                         f"dataset={config.dataset!r}")
    return run_recipe(_TextRun(config, TextRecipe() if recipe is None else recipe,
                               RunHooks() if hooks is None else hooks))


class _TextRun(Recipe):
    """What the text recipe fills into the run skeleton: tokenised snippets ordered by length,
    the pretrained encoder with a fresh head (full, LoRA or bias-only), Adam with its warm-up,
    LP-FT's probe before DP-SGD, accuracy on tokenised snippets, the trainable tensors kept."""

    def __init__(self, config: RunConfig, recipe: TextRecipe, hooks: RunHooks) -> None:
        # RunConfig checked the model, the unit (for a text dataset) and max_length
        self.config, self.recipe, self.hooks = config, recipe, hooks
        self.mode = text_mode(config)
        defaults = TEXT_DEFAULTS[self.mode]
        self.head_learning_rate = float(recipe.head_learning_rate
                                        if recipe.head_learning_rate is not None
                                        else defaults["head_learning_rate"])
        check_range("head_learning_rate", self.head_learning_rate, 0.0, math.inf,
                    low_open=True, high_open=True)
        self.clip_head_separately = bool(defaults["clip_head_separately"]
                                         if recipe.clip_head_separately is None
                                         else recipe.clip_head_separately)
        self.max_length = 64 if config.max_length is None else config.max_length
        self.adam_eps = 1e-8 if config.adam_eps is None else float(config.adam_eps)
        self.lora_rank = LORA_RANK if config.lora_rank is None else config.lora_rank
        physical = recipe.max_physical_batch_size
        if physical is None:
            physical = 64 if torch.device(config.device or "cpu").type == "cpu" else 256
        self.optimisation = Optimisation(
            epochs=int(config.epochs if config.epochs is not None else defaults["epochs"]),
            learning_rate=float(config.learning_rate if config.learning_rate is not None
                                else defaults["learning_rate"]),
            clip_norm=float(config.clip_norm if config.clip_norm is not None
                            else defaults["clip_norm"]),
            batch_size=config.batch_size, default_batch_size=defaults["batch_size"],
            max_physical_batch_size=physical, accounting=recipe.accounting,
            example="review snippet",
        )
        self.probe: Any = None

    def load(self) -> RecipeData:
        c = self.config
        train = datasets.rotten_tomatoes("train", limit=c.train_limit)
        if c.validation:  # a search: the held-out movies of the training split, never test
            train, test = datasets.split_rotten_tomatoes(train)
            if c.test_limit is not None:
                test = dataclasses.replace(
                    test, texts=test.texts[:c.test_limit], labels=test.labels[:c.test_limit],
                    movies=test.movies[:c.test_limit])
        else:
            test = datasets.rotten_tomatoes("test", limit=c.test_limit)
        return RecipeData(train=train, targets=None, test=test, size=len(train.labels),
                          unit_ids=None if c.unit == "example" else train.movies)

    def prepare(self, data: RecipeData) -> RecipeData:
        """Tokenised snippets, shortest first: the samplers treat every index alike (so the
        order changes no privacy event) and return a batch's indices in dataset order, so each
        physical chunk holds snippets of similar length and :func:`trim_padding` cuts most of
        its padding (about half the tokens of a batch at max_length 64)."""
        from dpfy.models.pretrained import load_minilm_tokenizer

        tokenizer = load_minilm_tokenizer()
        train, test = data.train, data.test
        train_data = tokenize(train.texts, train.labels, self.max_length, tokenizer)
        test_data = tokenize(test.texts, test.labels, self.max_length, tokenizer)
        truncated = truncated_fraction(train.texts, self.max_length, tokenizer)
        order = np.argsort(train_data.lengths().numpy(), kind="stable")
        return RecipeData(
            train=train_data.reordered(order), targets=None, test=test_data, size=data.size,
            unit_ids=None if data.unit_ids is None else train.movies[order],
            diagnostics={"truncated_fraction": truncated},
        )

    def model(self, device: torch.device) -> nn.Module:
        c = self.config
        return make_text_model(c.model or "minilm", lora=c.lora, lora_rank=self.lora_rank,
                               lora_targets=c.lora_targets, bias_only=c.bias_only).to(device)

    def optimizer(self, net: nn.Module) -> torch.optim.Optimizer:
        return text_optimizer(net, self.optimisation.learning_rate, self.head_learning_rate,
                              self.adam_eps)

    def before_training(self, net: nn.Module, data: RecipeData, batches: Sampler,
                        accounting: str, randomness: Randomness) -> float | None:
        c = self.config
        if c.linear_probe is None:
            return None
        from dpfy.training import lpft  # LP-FT: stage 1 here, its records lead the ledger

        self.probe = lpft.linear_probe(net, data.train, c.linear_probe * c.target_epsilon,
                                       c.delta, randomness)
        return lpft.calibrate_after(self.probe.event, batches, self.optimisation.epochs,
                                    c.target_epsilon, c.delta, accounting)

    def leading_callbacks(self, optimizer: torch.optim.Optimizer,
                          batches: Sampler) -> tuple[Callable[[ProgressInfo], None], ...]:
        if self.config.warmup <= 0:
            return ()
        steps = self.config.warmup * self.optimisation.epochs * int(batches.steps_per_epoch)
        return (LinearWarmUp(optimizer, max(1, round(steps))),)

    def trainer(self, net: nn.Module, optimizer: torch.optim.Optimizer, data: RecipeData,
                batches: Sampler, user_args: dict[str, Any],
                options: TrainerOptions) -> PrivateTrainer:
        cls = _UserTextTrainer if user_args else _TextTrainer
        options = dataclasses.replace(
            options, collate_fn=collate_trimmed,
            clip_groups=("head.",) if self.clip_head_separately else ())
        return cls(net, optimizer, sequence_classification_loss, data.train, None, batches,
                   test_tokens=data.test, **user_args, options=options)

    def metadata(self, ledger: Ledger, net: nn.Module, batch_size: int) -> str:
        c, probe, lora = self.config, self.probe, self.config.lora
        if probe is not None:
            ledger.replay(probe.ledger.entries)
            ledger.record_metadata(linear_probe={
                "method": "DP-FC (Mehta et al. 2023) on the frozen encoder's normalised mean "
                          "embeddings; the head starts at its weights",
                "share": c.linear_probe, "epsilon_alone": probe.epsilon,
            })  # its training accuracy and time were computed without noise: diagnostics only
        model_name = text_model_name(c)
        ledger.record_metadata(
            dataset=c.dataset, model=model_name, learning_rate=self.optimisation.learning_rate,
            head_learning_rate=self.head_learning_rate, batch_size=batch_size,
            max_length=self.max_length,
            clipping="head and encoder separately (C / sqrt 2 each)"
            if self.clip_head_separately else "joint",
            fine_tuning=self.mode, warmup=c.warmup, adam_eps=self.adam_eps,
            tan_steps=c.tan_steps, lora_rank=self.lora_rank if lora else None,
            lora_targets=list(LORA_TARGETS[c.lora_targets]) if lora else None,
            evaluated_on="validation movies of the training split" if c.validation
            else "test split",
            trainable_parameters=int(sum(p.numel() for p in net.parameters()
                                         if p.requires_grad)),
            unit_of_privacy=users.unit_description(c.unit, c.cap, self.optimisation.example)
            + ("; a movie has 2 to 35 snippets" if c.unit == "example" else ""),
            released_output="final model" + (" (LoRA factors and head)" if lora else
                                             " (biases and head)" if c.bias_only else ""),
            data_accesses="final training run only (hyperparameter tuning not accounted)"
            + ("; the linear probe and the fine-tuning (one ledger)" if probe else ""),
        )
        return model_name

    def progress(self, trainer: PrivateTrainer, accounting: str, steps: int) -> Any:
        bar = _RunningEpsilon(lambda: trainer.ledger, self.config.delta, accounting, steps)
        trainer.callbacks = (*trainer.callbacks, bar)
        return bar

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return host_copy(model.state_dict().items() if self.mode == "full" else (
            (n, p) for n, p in model.named_parameters() if p.requires_grad))

    def diagnostics(self, data: RecipeData) -> dict[str, Any]:
        # read from the training snippets without noise: never beside the model
        return dict(data.diagnostics) | ({} if self.probe is None else {
            "linear_probe_train_accuracy": self.probe.train_accuracy,
            "linear_probe_seconds": self.probe.seconds,
        })
