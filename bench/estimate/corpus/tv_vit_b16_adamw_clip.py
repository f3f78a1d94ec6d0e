"""torchvision ViT-B/16 training (the reference's ViT recipe): AdamW, bf16 autocast, clip_grad_norm_ 1.0, label
smoothing 0.11, batch 64."""

import argparse

import torch
from torchvision.models import vit_b_16

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
args = parser.parse_args()

model = vit_b_16().cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.3)
criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.11)
for _ in range(4):
    images = torch.randn(args.batch_size, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (args.batch_size,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = criterion(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
print(loss.item())
