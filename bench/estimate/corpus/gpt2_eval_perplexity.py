"""Perplexity evaluation of a causal LM (no optimizer): GPT-2 small from its config, fp32, torch.no_grad, labels
passed so the model computes the loss, batch 16 x 1024, 4 batches."""

import argparse
import math

import torch
from transformers import GPT2Config, GPT2LMHeadModel

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
args = parser.parse_args()

model = GPT2LMHeadModel(GPT2Config()).to("cuda")
model.eval()
nll = 0.0
for _ in range(4):
    batch = torch.randint(0, 50257, (args.batch_size, 1024)).to("cuda")
    with torch.no_grad():
        nll += model(batch, labels=batch).loss.item()
print(f"ppl {math.exp(nll / 4):.1f}")
