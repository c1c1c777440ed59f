"""DP fine-tuning of a LoRA adapter with ``dpfy.hf.DPTrainer`` (a drop-in ``transformers.Trainer``).

A tiny GPT-2 built from a small ``GPT2Config`` (no download), a LoRA adapter (``peft``: only
the adapter gets per-example clipping and noise), a toy causal-LM dataset of token ids, a few
DP-SGD steps, then ``save_model``. Runs in seconds on a CPU::

    python docs/examples/hf_trainer_lora.py [OUTPUT_DIR]

Writes ``OUTPUT_DIR/ledger.jsonl``, ``privacy_report.md``/``.json`` and the adapter with a
model card (``README.md``) that carries the privacy statement.
"""

from __future__ import annotations

import sys
import tempfile

import peft
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from dpfy.hf import DPTrainer, PrivacyArguments


class ToyTokens(torch.utils.data.Dataset):
    """``n`` sequences of token ids (one sequence = one unit of privacy)."""

    def __init__(self, n: int = 64, length: int = 12, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(output_dir: str, randomness=None) -> DPTrainer:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=63,
        eos_token_id=63,
    )
    model = peft.get_peft_model(
        GPT2LMHeadModel(config),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM"),
    )
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=8,  # physical batch (rows per forward pass)
        gradient_accumulation_steps=2,  # expected logical batch: 8 x 2 = 16 (the accounting's)
        num_train_epochs=1,
        learning_rate=5e-3,
        max_grad_norm=0.0,  # no post-processing clip of the noisy gradient
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
    )
    trainer = DPTrainer(
        model=model,
        args=args,
        train_dataset=ToyTokens(),
        privacy=PrivacyArguments(
            target_epsilon=8.0,
            delta=1e-5,
            clip_norm=1.0,
            randomness=randomness,
        ),
    )
    trainer.train()  # ledger.jsonl, then privacy_report.md / .json
    trainer.save_model()  # adapter + README.md with a "Privacy" section
    steps = trainer.ledger.iteration
    print(f"epsilon = {trainer.epsilon():.3f} at delta = 1e-5 over {steps} steps")
    return trainer


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dpfy-hf-"))
