"""QLoRA-free LoRA on a Llama-style model in bf16 (the usual SFT script without the Trainer): a 0.7B-parameter
Llama from its config (12 layers, hidden 2048, GQA) loaded in bf16, LoRA r=64 on every projection, gradient
checkpointing (reentrant, the HF default), AdamW on the adapters, batch 8 x 1024."""

import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=1024)
args = parser.parse_args()

config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
                     num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048)  # fmt: skip
model = LlamaForCausalLM(config).to(torch.bfloat16)
model.gradient_checkpointing_enable()
model.enable_input_require_grads()
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
peft_config = LoraConfig(r=64, lora_alpha=16, lora_dropout=0.1, task_type="CAUSAL_LM", target_modules=targets)
model = get_peft_model(model, peft_config)
model.to("cuda")
optimizer = torch.optim.AdamW(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-4)
for _step in range(4):
    batch = torch.randint(0, 32000, (args.batch_size, args.seq_len), device="cuda")
    loss = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
    optimizer.step()
    optimizer.zero_grad()
print(loss.item())
