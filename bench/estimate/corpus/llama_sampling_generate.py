"""Chat-style sampling from a small Llama (from its config: 8 layers, hidden 1024, grouped-query attention) in
bf16: batch 48, prompts of 512 tokens, top-p sampling, max_new_tokens 32."""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=48)
parser.add_argument("--prompt-len", type=int, default=512)
parser.add_argument("--max-new-tokens", type=int, default=32)
args = parser.parse_args()

torch.manual_seed(0)
config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)  # fmt: skip
model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
model.eval()
input_ids = torch.randint(3, 32000, (args.batch_size, args.prompt_len), device="cuda")
with torch.no_grad():
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, top_p=0.9,
                         temperature=0.7, max_new_tokens=args.max_new_tokens, pad_token_id=0)  # fmt: skip
print(out.shape)
