"""MobileNetV3-Large training in fp32 (the torchvision reference's mobilenet recipe: RMSprop-free SGD variant),
depthwise convolutions and hardswish, batch 256 at 224, cosine LR."""

import argparse

import torch
import torchvision

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=256)
args = parser.parse_args()

model = torchvision.models.mobilenet_v3_large().cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=4e-5)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
criterion = torch.nn.CrossEntropyLoss()
for _ in range(4):
    x = torch.randn(args.batch_size, 3, 224, 224).cuda()
    y = torch.randint(0, 1000, (args.batch_size,)).cuda()
    loss = criterion(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
print(loss.item())
