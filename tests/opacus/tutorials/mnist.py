"""Opacus' MNIST example (examples/mnist.py), as people copy it: SampleConvNet, a noise
multiplier given on the command line, epsilon read from the accountant after each epoch.
Random tensors of MNIST's shape stand in for the data (no download); sizes are tiny."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

SIGMA = 1.1
MAX_PER_SAMPLE_GRAD_NORM = 1.0
DELTA = 1e-5
EPOCHS = 2
BATCH_SIZE = 8


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        # x of shape [B, 1, 28, 28]
        x = F.relu(self.conv1(x))  # -> [B, 16, 14, 14]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 16, 13, 13]
        x = F.relu(self.conv2(x))  # -> [B, 32, 5, 5]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 32, 4, 4]
        x = x.view(-1, 32 * 4 * 4)  # -> [B, 512]
        x = F.relu(self.fc1(x))  # -> [B, 32]
        x = self.fc2(x)  # -> [B, 10]
        return x


def train(model, device, train_loader, optimizer, privacy_engine, epoch):
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    epsilon = privacy_engine.accountant.get_epsilon(delta=DELTA)
    print(f"Train Epoch: {epoch} Loss: {sum(losses) / len(losses):.6f} "
          f"(epsilon = {epsilon:.2f}, delta = {DELTA})")


torch.manual_seed(0)
device = torch.device("cpu")
train_data = TensorDataset(torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)))
train_loader = DataLoader(train_data, batch_size=BATCH_SIZE, shuffle=True)
model = SampleConvNet().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0)
privacy_engine = PrivacyEngine()
model, optimizer, train_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    noise_multiplier=SIGMA,
    max_grad_norm=MAX_PER_SAMPLE_GRAD_NORM,
)
for epoch in range(1, EPOCHS + 1):
    train(model, device, train_loader, optimizer, privacy_engine, epoch)
FINAL_EPSILON = privacy_engine.get_epsilon(DELTA)
