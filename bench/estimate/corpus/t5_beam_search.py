"""Beam-search translation: T5-base from its config in bf16, a batch of 16 sources of 256 tokens, num_beams 4,
max_new_tokens 24."""

import argparse

import torch
from transformers import T5Config, T5ForConditionalGeneration

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--num-beams", type=int, default=4)
parser.add_argument("--max-new-tokens", type=int, default=24)
args = parser.parse_args()

config = T5Config(d_model=768, d_ff=3072, num_layers=12, num_heads=12, decoder_start_token_id=0)
model = T5ForConditionalGeneration(config).to("cuda", dtype=torch.bfloat16).eval()
src = torch.randint(2, config.vocab_size, (args.batch_size, 256), device="cuda")
with torch.inference_mode():
    out = model.generate(input_ids=src, attention_mask=torch.ones_like(src), num_beams=args.num_beams,
                         max_new_tokens=args.max_new_tokens, early_stopping=True)  # fmt: skip
print(out.shape)
