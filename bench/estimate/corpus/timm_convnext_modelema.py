"""timm ConvNeXt-Tiny with timm's own ModelEmaV3, AdamW, bf16 autocast, channels_last, drop path 0.1,
gradient clipping, batch 96."""

import argparse

import timm
import torch
from timm.utils import ModelEmaV3

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=96)
parser.add_argument("--img-size", type=int, default=224)
args = parser.parse_args()

model = timm.create_model("convnext_tiny", pretrained=False, drop_path_rate=0.1)
model = model.to("cuda", memory_format=torch.channels_last)
ema = ModelEmaV3(model, decay=0.9999)
optimizer = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.05)
criterion = torch.nn.CrossEntropyLoss()
for step in range(4):
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device="cuda")
    images = images.to(memory_format=torch.channels_last)
    target = torch.randint(0, 1000, (args.batch_size,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = criterion(model(images), target)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    optimizer.step()
    ema.update(model, step=step)
print(f"loss {loss.item():.3f}")
