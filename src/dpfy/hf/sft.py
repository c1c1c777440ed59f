"""``DPSFTTrainer``: TRL's ``SFTTrainer`` (causal-LM fine-tuning on text) with DP-SGD.

``DPSFTTrainer(DPTrainingMixin, SFTTrainer)``: TRL prepares the data as usual (tokenises the
``text`` column, or prompt/completion and chat datasets, appends EOS, truncates to
``max_length``, builds ``labels`` with -100 on every position not to learn, wraps the model
with ``peft_config``), and :class:`dpfy.hf.trainer.DPTrainingMixin` does everything private:
dpfy's sampler draws the logical batches, each example's causal-LM loss is its mean over its
labelled tokens (:func:`dpfy.training.losses.causal_lm_loss`: -100 labels and padding give
exactly zero, so one loss per example reaches the clipping), the Gaussian query writes the
ledger before the noise, ``train()`` writes ``privacy_report.md``/``.json`` and
``save_model()`` (and TRL's own model card) gets the ``## Privacy`` section. The unit of
privacy is one row of the training set (one text, or one prompt/completion pair, or one
conversation).

TRL's ``SFTConfig`` defaults to ``bf16=True`` and ``gradient_checkpointing=True``; both are
honoured (bf16 autocast of the forward with fp32 norms, clipping and noise; transformers'
non-reentrant checkpointing, exact with the per-example hooks). Pass ``bf16=False`` for an
fp32 forward.

What changes from ``SFTTrainer``: its ``compute_loss`` is not used (it returns one mean over
the batch's tokens, which cannot be clipped per example), so its extra training metrics
(token accuracy, entropy, token counts) are not logged; ``max_grad_norm`` is post-processing
of the noisy gradient (:mod:`dpfy.hf.trainer`).

Refused at construction, besides :mod:`dpfy.hf.trainer`'s refusals (each would change the unit
of privacy or the loss that is clipped, or be silently ignored): ``packing`` (several rows
joined in one sequence: one clipped "example" would be several people's texts) and
``padding_free`` (the whole batch flattened into one row); ``loss_type`` other than ``"nll"``
(the per-example loss is the token mean of the negative log-likelihood);
``activation_offloading`` (not tested with the per-example hooks yet).

Example: ``docs/examples/trl_sft_lora.py`` (tiny GPT-2 from a config, peft LoRA, a few lines).
"""

from __future__ import annotations

from typing import Any

from trl.trainer.sft_trainer import SFTTrainer

from dpfy.hf.trainer import DPTrainingMixin


class DPSFTTrainer(DPTrainingMixin, SFTTrainer):
    """TRL ``SFTTrainer`` with DP-SGD, a ledger and a privacy report (module docstring).

    Arguments: those of ``SFTTrainer`` (``model``, ``args`` as an ``SFTConfig``,
    ``train_dataset``, ``processing_class``, ``peft_config``, ...) plus the privacy ones of
    :class:`dpfy.hf.trainer.DPTrainingMixin` (``privacy=PrivacyArguments(target_epsilon=...,
    delta=..., clip_norm=..., ...)``). Example::

        trainer = DPSFTTrainer(model=model, args=SFTConfig(output_dir=out, ...),
                               train_dataset=Dataset.from_dict({"text": lines}),
                               processing_class=tokenizer, peft_config=LoraConfig(...),
                               privacy=PrivacyArguments(target_epsilon=8.0,
                                                        delta=1e-5, clip_norm=1.0))
        trainer.train()          # out/ledger.jsonl, out/privacy_report.md
        trainer.save_model()     # out/README.md gets a "Privacy" section
    """

    def __init__(self, model: Any = None, args: Any = None, *trainer_args: Any,
                 **kwargs: Any) -> None:
        _refuse_sft_arguments(args)
        super().__init__(model, args, *trainer_args, **kwargs)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """TRL's card (written when a checkpoint is saved), then the privacy section."""
        super().create_model_card(*args, **kwargs)
        ledger = self._dp_ledger
        if ledger is not None and ledger.iteration > 0 and self.args.output_dir:
            import os

            from dpfy.hf.model_card import write_model_card

            target = self.args.output_dir
            write_model_card(
                target, ledger, delta=self._dp_delta, method=self._dp_method,
                ledger_ref=os.path.relpath(self.ledger_path, target),
            )


def _refuse_sft_arguments(args: Any) -> None:
    """Refuse the SFT settings that change the unit of privacy or the clipped loss."""
    checks = [
        (getattr(args, "packing", False), "packing=True (several rows joined in one sequence "
         "would be clipped as one example)"),
        (getattr(args, "padding_free", False), "padding_free=True (the batch is flattened into "
         "one row)"),
        (getattr(args, "loss_type", "nll") != "nll",
         f"loss_type={getattr(args, 'loss_type', None)!r} (only 'nll', the per-example token "
         "mean, is clipped per example)"),
        (getattr(args, "activation_offloading", False), "activation_offloading=True"),
    ]
    bad = [what for refused, what in checks if refused]
    if bad:
        raise ValueError(
            f"DPSFTTrainer refuses {', '.join(bad)}: each example's loss must be one row's own "
            "loss for per-example clipping to bound its influence"
        )
