"""LoRA fine-tuning with peft and gradient checkpointing (the PEFT causal-LM example's shape): GPT-2 large from its
config (36 layers, 1280 wide), LoRA r=16 on c_attn and c_proj, the base frozen, enable_input_require_grads,
AdamW on the adapters, fp16 autocast with GradScaler, batch 16 x 512."""

import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--seq-len", type=int, default=512)
parser.add_argument("--lora-r", type=int, default=16)
args = parser.parse_args()

base = GPT2LMHeadModel(GPT2Config(n_embd=1280, n_layer=36, n_head=20))
base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
base.enable_input_require_grads()
lora = LoraConfig(r=args.lora_r, lora_alpha=32, target_modules=["c_attn", "c_proj"], lora_dropout=0.05,
                  fan_in_fan_out=True, task_type="CAUSAL_LM")  # fmt: skip
model = get_peft_model(base, lora).cuda()
model.print_trainable_parameters()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
scaler = torch.amp.GradScaler("cuda")
model.train()
for step in range(4):
    ids = torch.randint(0, 50257, (args.batch_size, args.seq_len), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    print(step, loss.item())
