"""Greedy text generation with the KV cache: GPT-2 small from its config in fp16, a batch of 64 prompts of 256
tokens, max_new_tokens 32."""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--prompt-len", type=int, default=256)
parser.add_argument("--max-new-tokens", type=int, default=32)
args = parser.parse_args()

model = GPT2LMHeadModel(GPT2Config()).half().cuda().eval()
prompts = torch.randint(0, 50257, (args.batch_size, args.prompt_len), device="cuda")
out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.max_new_tokens,
                     do_sample=False, pad_token_id=50256)  # fmt: skip
print(out.shape)
