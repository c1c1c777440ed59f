"""Opacus' name-classification tutorial (tutorials/building_lstm_name_classifier.ipynb), as
people copy it: characters through an embedding, DPLSTM and a linear head on the last step,
variable-length names padded by a collate function. Random character ids stand in for the
names (no download); sizes are tiny."""

import torch
import torch.nn as nn
from opacus import PrivacyEngine
from opacus.layers import DPLSTM
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

VOCAB_SIZE = 30
NUM_CLASSES = 4
BATCH_SIZE = 8
EPOCHS = 2
MAX_GRAD_NORM = 1.5
NOISE_MULTIPLIER = 1.2
DELTA = 8e-5
SECURE_MODE = False


class CharNNClassifier(nn.Module):
    def __init__(self, embedding_size, hidden_size, output_size, num_lstm_layers=1,
                 bidirectional=False, vocab_size=VOCAB_SIZE):
        super().__init__()
        self.embedding_size = embedding_size
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.lstm = DPLSTM(embedding_size, hidden_size, num_layers=num_lstm_layers,
                           bidirectional=bidirectional, batch_first=True)
        self.out_layer = nn.Linear(hidden_size, output_size)

    def forward(self, x, hidden=None):
        x = self.embedding(x)  # -> [B, T, D]
        x, _ = self.lstm(x, hidden)  # -> [B, T, H]
        x = x[:, -1, :]  # -> [B, H]
        x = self.out_layer(x)  # -> [B, C]
        return x


def padded_collate(batch, padding_idx=0):
    x = pad_sequence([elem[0] for elem in batch], batch_first=True, padding_value=padding_idx)
    y = torch.stack([elem[1] for elem in batch]).long()
    return x, y


def train(model, criterion, optimizer, train_loader, epoch, privacy_engine, device="cpu"):
    accs = []
    losses = []
    for x, y in train_loader:
        x = x.to(device)
        y = y.to(device)
        logits = model(x)
        loss = criterion(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        preds = logits.argmax(-1)
        n_correct = float(preds.eq(y).sum())
        batch_accuracy = n_correct / len(y)
        accs.append(batch_accuracy)
        losses.append(float(loss))
    printstr = (f"\t Epoch {epoch}. Accuracy: {sum(accs) / len(accs):.6f} | "
                f"Loss: {sum(losses) / len(losses):.6f}")
    if privacy_engine:
        epsilon = privacy_engine.get_epsilon(DELTA)
        printstr += f" | (ε = {epsilon:.2f}, δ = {DELTA})"
    print(printstr)


torch.manual_seed(0)
names = [torch.randint(1, VOCAB_SIZE, (int(k),)) for k in torch.randint(3, 10, (32,))]
train_ds = [(name, torch.tensor(i % NUM_CLASSES)) for i, name in enumerate(names)]
train_loader = DataLoader(train_ds, batch_size=BATCH_SIZE, collate_fn=padded_collate,
                          shuffle=True)
model = CharNNClassifier(16, 16, NUM_CLASSES, 1, False, VOCAB_SIZE)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
privacy_engine = PrivacyEngine(secure_mode=SECURE_MODE)
model, optimizer, train_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    noise_multiplier=NOISE_MULTIPLIER,
    max_grad_norm=MAX_GRAD_NORM,
)
for epoch in range(EPOCHS):
    train(model, criterion, optimizer, train_loader, epoch, privacy_engine)
FINAL_EPSILON = privacy_engine.get_epsilon(DELTA)
