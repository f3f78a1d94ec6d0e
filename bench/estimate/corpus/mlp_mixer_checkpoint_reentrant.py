"""Activation checkpointing by hand with torch.utils.checkpoint, both kinds: an MLP-Mixer-B/16 style model whose
even blocks use checkpoint(use_reentrant=True) and odd blocks checkpoint(use_reentrant=False), AdamW, fp32,
batch 128 at 224."""

import argparse

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=128)
args = parser.parse_args()


class MixerBlock(nn.Module):
    def __init__(self, tokens=196, dim=768):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 384), nn.GELU(), nn.Linear(384, tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, 3072), nn.GELU(), nn.Linear(3072, dim))

    def forward(self, x):
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, depth=12):
        super().__init__()
        self.stem = nn.Conv2d(3, 768, 16, 16)
        self.blocks = nn.ModuleList([MixerBlock() for _ in range(depth)])
        self.norm = nn.LayerNorm(768)
        self.head = nn.Linear(768, 1000)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=(i % 2 == 0))
        return self.head(self.norm(x).mean(1))


model = Mixer().cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
for _ in range(4):
    x = torch.randn(args.batch_size, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (args.batch_size,), device="cuda")
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(loss.item())
