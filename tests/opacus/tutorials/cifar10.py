"""Opacus' CIFAR-10 tutorial (tutorials/building_image_classifier.ipynb), as people copy it:
ModuleValidator.fix for the BatchNorm layers, make_private_with_epsilon, BatchMemoryManager
with physical batches smaller than the logical ones. A small BatchNorm CNN on random tensors
of CIFAR's shape replaces ResNet-18 on the real data (no download). The accountant is "rdp"
here to keep Opacus' own calibration within a second (its "prv" calibration takes 3-4 s); the
README's example runs make_private_with_epsilon with the default "prv"."""

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.validators import ModuleValidator
from torch.utils.data import DataLoader, TensorDataset

MAX_GRAD_NORM = 1.2
EPSILON = 50.0
DELTA = 1e-5
EPOCHS = 2
LR = 1e-3
BATCH_SIZE = 16
MAX_PHYSICAL_BATCH_SIZE = 8


def accuracy(preds, labels):
    return (preds == labels).mean()


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )


torch.manual_seed(0)
device = torch.device("cpu")
train_dataset = TensorDataset(torch.randn(48, 3, 32, 32), torch.randint(0, 10, (48,)))
train_loader = DataLoader(train_dataset, batch_size=BATCH_SIZE)
model = make_model()
errors = ModuleValidator.validate(model, strict=False)
assert len(errors) == 2, errors  # the two BatchNorm layers
model = ModuleValidator.fix(model)
assert ModuleValidator.validate(model, strict=False) == []
model = model.to(device)
optimizer = optim.RMSprop(model.parameters(), lr=LR)
privacy_engine = PrivacyEngine(accountant="rdp")
model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    epochs=EPOCHS,
    target_epsilon=EPSILON,
    target_delta=DELTA,
    max_grad_norm=MAX_GRAD_NORM,
)
print(f"Using sigma={optimizer.noise_multiplier} and C={MAX_GRAD_NORM}")


def train(model, train_loader, optimizer, epoch, device):
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses = []
    top1_acc = []
    with BatchMemoryManager(
        data_loader=train_loader,
        max_physical_batch_size=MAX_PHYSICAL_BATCH_SIZE,
        optimizer=optimizer,
    ) as memory_safe_data_loader:
        for _i, (images, target) in enumerate(memory_safe_data_loader):
            assert len(images) <= MAX_PHYSICAL_BATCH_SIZE
            optimizer.zero_grad()
            images = images.to(device)
            target = target.to(device)
            output = model(images)
            loss = criterion(output, target)
            preds = np.argmax(output.detach().cpu().numpy(), axis=1)
            labels = target.detach().cpu().numpy()
            acc = accuracy(preds, labels)
            losses.append(loss.item())
            top1_acc.append(acc)
            loss.backward()
            optimizer.step()
    epsilon = privacy_engine.get_epsilon(DELTA)
    print(f"Train Epoch: {epoch} Loss: {np.mean(losses):.6f} "
          f"Acc@1: {np.mean(top1_acc) * 100:.6f} (epsilon = {epsilon:.2f}, delta = {DELTA})")


for epoch in range(EPOCHS):
    train(model, train_loader, optimizer, epoch + 1, device)
FINAL_EPSILON = privacy_engine.get_epsilon(DELTA)
