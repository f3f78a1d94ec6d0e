"""EfficientNet-B0 (depthwise convolutions, SiLU, squeeze-excitation) from torchvision, RMSprop as in the paper,
fp16 autocast with GradScaler, channels_last, batch 192 at 224."""

import argparse

import torch
from torchvision.models import efficientnet_b0

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=192)
args = parser.parse_args()

model = efficientnet_b0(num_classes=1000).cuda().to(memory_format=torch.channels_last)
optimizer = torch.optim.RMSprop(model.parameters(), lr=0.016, alpha=0.9, eps=0.001, momentum=0.9, weight_decay=1e-5)
scaler = torch.amp.GradScaler()
for _step in range(4):
    x = torch.randn(args.batch_size, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch_size,), device="cuda")
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print(loss.item())
