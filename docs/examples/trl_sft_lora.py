"""DP supervised fine-tuning on text with TRL's ``SFTTrainer``: ``dpfy.hf.DPSFTTrainer``.

A tiny GPT-2 built from a small ``GPT2Config`` and a character-level tokenizer built here
(no download), a handful of text lines (one line = one unit of privacy), a LoRA adapter given
to TRL as ``peft_config`` (only the adapter gets per-example clipping and noise), a few DP-SGD
steps, then ``save_model``. TRL tokenises the lines, appends EOS and pads; dpfy reduces each
line's token losses to one loss (padding labelled -100 counts for nothing), clips it, adds the
noise and writes the ledger. Runs in seconds on a CPU (needs ``pip install -e ".[nlp,sft]"``)::

    python docs/examples/trl_sft_lora.py [OUTPUT_DIR]

Writes ``OUTPUT_DIR/ledger.jsonl``, ``privacy_report.md``/``.json`` and the adapter with a
model card (``README.md``) that carries the privacy statement.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally

import peft  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig  # noqa: E402

from dpfy.hf import DPSFTTrainer, PrivacyArguments  # noqa: E402

LINES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "birds sing at dawn",
    "rain falls on the roof",
    "the sun sets in the west",
    "fish swim in the sea",
    "snow covers the hills",
    "wind moves the tall grass",
]


def char_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ``texts`` with ``<pad>`` and ``<eos>``."""
    chars = sorted({c for t in texts for c in t})
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def main(output_dir: str, randomness=None, steps: int = 4) -> DPSFTTrainer:
    torch.manual_seed(0)
    lines = LINES * 4  # 32 rows
    tokenizer = char_tokenizer(lines)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    args = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,  # physical batch (rows per forward pass)
        gradient_accumulation_steps=2,  # expected logical batch: 4 x 2 = 8 (the accounting's)
        max_steps=steps,
        max_length=48,  # TRL truncates longer rows
        learning_rate=5e-3,
        max_grad_norm=0.0,  # no post-processing clip of the noisy gradient
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        dataloader_pin_memory=False,
        # TRL's defaults, kept: bf16=True (bf16 forward; dpfy clips and noises in fp32) and
        # gradient_checkpointing=True (non-reentrant: exact with dpfy's per-example norms)
    )
    trainer = DPSFTTrainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Dataset.from_dict({"text": lines}),
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM"
        ),
        privacy=PrivacyArguments(
            target_epsilon=8.0,
            delta=1e-5,
            clip_norm=1.0,
            randomness=randomness,
        ),
    )
    trainer.train()  # ledger.jsonl, then privacy_report.md / .json
    trainer.save_model()  # adapter + README.md with a "Privacy" section
    print(f"epsilon = {trainer.epsilon():.3f} at delta = 1e-5 over "
          f"{trainer.ledger.iteration} steps")
    return trainer


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dpfy-sft-"))
