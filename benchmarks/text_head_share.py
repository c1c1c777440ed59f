"""How much of a snippet's gradient norm the classification head holds, full vs LoRA.

Why full DP fine-tuning clips its head apart from the encoder (benchmarks/results/sentiment/
README.md): per-example gradients of 32 training snippets through all-MiniLM-L6-v2 with the
mean-pooled head's weights drawn at std 0.01 and 0.1 (a grown head; the real one starts at zero,
where the encoder gets no gradient at all). Prints the median head norm, the median norm of
everything else that is trainable, and the head's median share of the squared norm.

    PYTHONPATH=src python benchmarks/text_head_share.py
"""

import numpy as np
import torch

from dpfy import datasets
from dpfy.models.pretrained import load_minilm_tokenizer
from dpfy.training.losses import sequence_classification_loss
from dpfy.training.text import make_text_model, tokenize, trim_padding


def squared_norms(net: torch.nn.Module) -> tuple[float, float]:
    """(head, everything else trainable): squared norms of the current ``.grad``."""
    head = rest = 0.0
    for name, p in net.named_parameters():
        if p.grad is not None:
            sq = float((p.grad**2).sum())
            head, rest = (head + sq, rest) if name.startswith("head.") else (head, rest + sq)
    return head, rest


def main() -> None:
    torch.set_num_threads(1)
    tok = load_minilm_tokenizer()
    train = datasets.rotten_tomatoes("train", limit=32)
    data = tokenize(train.texts, train.labels, 64, tok)
    for lora, scale in ((False, 0.01), (False, 0.1), (True, 0.01), (True, 0.1)):
        torch.manual_seed(0)  # the LoRA factors' random start
        net = make_text_model("minilm", lora=lora)
        torch.manual_seed(1)
        torch.nn.init.normal_(net.head.weight, std=scale)
        norms = []
        for i in range(len(data)):
            net.zero_grad()
            batch = trim_padding({k: v[i : i + 1] for k, v in data.tokens.items()})
            out = net(**batch)
            sequence_classification_loss(out, data.labels[i : i + 1]).sum().backward()
            norms.append(squared_norms(net))
        h, r = np.array(norms).T
        print(f"{'lora' if lora else 'full'}, head std {scale}: median head norm "
              f"{np.median(np.sqrt(h)):.3f}, other {np.median(np.sqrt(r)):.3f}, head share of "
              f"the squared norm {np.median(h / (h + r)):.4f}")


if __name__ == "__main__":
    main()
