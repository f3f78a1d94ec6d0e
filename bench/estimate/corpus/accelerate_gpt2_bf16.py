"""A training loop written for 🤗 accelerate (`accelerate launch train.py` on one GPU is the same as running it):
Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2), GPT-2 small from its config, a DataLoader
prepared by the accelerator, accelerator.backward, clip_grad_norm_ through the accelerator, a linear warmup
schedule, batch 16 x 512."""

import argparse

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--seq-len", type=int, default=512)
args = parser.parse_args()

accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
model = GPT2LMHeadModel(GPT2Config())
data = torch.randint(0, 50257, (args.batch_size * 8, args.seq_len))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=args.batch_size, shuffle=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.1)
scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=100)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
model.train()
for (batch,) in loader:
    with accelerator.accumulate(model):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
accelerator.print(f"loss {loss.item():.3f}")
