"""Batch evaluation of torchvision's ViT-B/16 (no optimizer) under bf16 autocast and torch.no_grad, batch 512,
softmax probabilities copied back to the host."""

import argparse

import torch
from torchvision.models import vit_b_16

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=512)
args = parser.parse_args()

model = vit_b_16().to("cuda").eval()
probs = []
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    for _ in range(3):
        x = torch.randn(args.batch_size, 3, 224, 224, device="cuda")
        probs.append(model(x).softmax(-1).float().cpu())
print(torch.cat(probs).shape)
