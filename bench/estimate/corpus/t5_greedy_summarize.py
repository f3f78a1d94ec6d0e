"""Batch summarization with greedy decoding (model.generate, no optimizer): T5-small from its config in fp32,
inputs of 512 tokens, batch 64, max_new_tokens 24, two batches."""

import argparse

import torch
from transformers import T5Config, T5ForConditionalGeneration

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--max-new-tokens", type=int, default=24)
args = parser.parse_args()

model = T5ForConditionalGeneration(T5Config(decoder_start_token_id=0, num_layers=6, d_model=512, d_ff=2048))
model = model.cuda().eval()
summaries = []
for _ in range(2):
    ids = torch.randint(2, 32128, (args.batch_size, 512)).cuda()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             min_new_tokens=args.max_new_tokens)  # fmt: skip
    summaries.append(out.cpu())
print([s.shape for s in summaries])
