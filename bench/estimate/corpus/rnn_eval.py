"""Batch evaluation of a trained 2-layer LSTM encoder (no optimizer): torch.inference_mode, batch 256 x 64
steps, 10 batches; sums the predictions."""

import torch
import torch.nn as nn

encoder = nn.LSTM(128, 512, num_layers=2, batch_first=True).cuda().eval()
head = nn.Linear(512, 10).cuda().eval()
total = 0
with torch.inference_mode():
    for _ in range(10):
        x = torch.randn(256, 64, 128, device="cuda")
        out, _ = encoder(x)
        total += head(out[:, -1]).argmax(1).sum().item()
print(total)
