import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy

torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 20), torch.randint(0, 2, (512,)))
model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
criterion = nn.CrossEntropyLoss()

model, optimizer, criterion, train_loader = dpfy.make_private(
    model, optimizer, data, loss_fn=criterion, expected_batch_size=64,
    target_epsilon=3.0, delta=1e-5, epochs=2, clip_norm=1.0,
)

for _ in range(2):
    for x, y in train_loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
print(f"epsilon = {optimizer.epsilon(1e-5):.2f}")
