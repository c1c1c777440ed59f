"""Opacus' BERT tutorial (tutorials/building_text_classifier.ipynb), as people copy it: a
BertForSequenceClassification with all but the last encoder layer, the pooler and the
classifier frozen, batches of (input_ids, attention_mask, token_type_ids, labels), the loss
the model computes itself (outputs[0]). A randomly initialised 2-layer BERT with hidden size
32 on random token ids replaces bert-base-cased on SNLI (no download)."""

import numpy as np
import torch
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

EPOCHS = 2
BATCH_SIZE = 8
MAX_GRAD_NORM = 0.1
NOISE_MULTIPLIER = 0.8
DELTA = 1e-5
LOGGING_INTERVAL = 2

torch.manual_seed(0)
config = BertConfig(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=64, max_position_embeddings=32, num_labels=3,
)
model = BertForSequenceClassification(config)
trainable_layers = [model.bert.encoder.layer[-1], model.bert.pooler, model.classifier]
total_params = 0
trainable_params = 0
for p in model.parameters():
    p.requires_grad = False
    total_params += p.numel()
for layer in trainable_layers:
    for p in layer.parameters():
        p.requires_grad = True
        trainable_params += p.numel()
print(f"Total parameters count: {total_params}")
print(f"Trainable parameters count: {trainable_params}")

n, length = 24, 8
input_ids = torch.randint(1, 100, (n, length))
attention_mask = torch.ones(n, length, dtype=torch.long)
attention_mask[: n // 2, length // 2 :] = 0
token_type_ids = torch.zeros(n, length, dtype=torch.long)
labels = torch.randint(0, 3, (n,))
train_dataset = TensorDataset(input_ids, attention_mask, token_type_ids, labels)
train_dataloader = DataLoader(train_dataset, batch_size=BATCH_SIZE)
device = torch.device("cpu")
model = model.to(device)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, eps=1e-8)
privacy_engine = PrivacyEngine()
model, optimizer, train_dataloader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=train_dataloader,
    noise_multiplier=NOISE_MULTIPLIER,
    max_grad_norm=MAX_GRAD_NORM,
    poisson_sampling=True,
)

for epoch in range(1, EPOCHS + 1):
    losses = []
    for step, batch in enumerate(train_dataloader):
        optimizer.zero_grad()
        batch = tuple(t.to(device) for t in batch)
        inputs = {
            "input_ids": batch[0],
            "attention_mask": batch[1],
            "token_type_ids": batch[2],
            "labels": batch[3],
        }
        outputs = model(**inputs)  # output = loss, logits, hidden_states, attentions
        loss = outputs[0]
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        if step > 0 and step % LOGGING_INTERVAL == 0:
            train_loss = np.mean(losses)
            eps = privacy_engine.get_epsilon(DELTA)
            print(f"Epoch: {epoch} | Step: {step} | Train loss: {train_loss:.3f} | "
                  f"eps: {eps:.1f}")
FINAL_EPSILON = privacy_engine.get_epsilon(DELTA)
