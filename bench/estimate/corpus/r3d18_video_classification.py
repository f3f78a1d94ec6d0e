"""Video classification (torchvision's video reference): R3D-18 (Conv3d), clips of 16 frames at 112 x 112,
400 classes, SGD, fp16 autocast with GradScaler, batch 16."""

import argparse

import torch
from torchvision.models.video import r3d_18

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--clip-len", type=int, default=16)
args = parser.parse_args()

model = r3d_18(num_classes=400).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
scaler = torch.amp.GradScaler("cuda")
for _ in range(4):
    video = torch.randn(args.batch_size, 3, args.clip_len, 112, 112, device="cuda")
    label = torch.randint(0, 400, (args.batch_size,), device="cuda")
    with torch.autocast("cuda"):
        loss = torch.nn.functional.cross_entropy(model(video), label)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print(loss.item())
