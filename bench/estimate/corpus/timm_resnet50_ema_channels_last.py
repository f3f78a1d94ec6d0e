"""timm-style training (train.py's shape): timm ResNet-50 in channels_last, a model EMA made with copy.deepcopy
before the model moves to the GPU, SGD with nesterov momentum, fp16 autocast with GradScaler, batch 128."""

import argparse
import copy

import timm
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--model-ema-decay", type=float, default=0.9998)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

model = timm.create_model("resnet50", pretrained=False, num_classes=1000)
model_ema = copy.deepcopy(model)
for p in model_ema.parameters():
    p.requires_grad_(False)
model.cuda().to(memory_format=torch.channels_last)
model_ema.cuda().eval()

optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
scaler = torch.amp.GradScaler("cuda")
loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
for _step in range(args.steps):
    x = torch.randn(args.batch_size, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch_size,), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    with torch.no_grad():
        for ema_v, model_v in zip(model_ema.state_dict().values(), model.state_dict().values(), strict=True):
            if ema_v.dtype.is_floating_point:
                ema_v.lerp_(model_v, 1 - args.model_ema_decay)
            else:
                ema_v.copy_(model_v)
print(loss.item())
