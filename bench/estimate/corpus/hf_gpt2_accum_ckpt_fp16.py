"""The HF Trainer with the memory-saving flags people reach for: GPT-2 from its config,
gradient_accumulation_steps=2, fp16, gradient_checkpointing, batch 8 x 1024 tokens."""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--grad-accum", type=int, default=2)
args = parser.parse_args()

config = GPT2Config()
model = GPT2LMHeadModel(config)
n = args.batch_size * args.grad_accum * 3
data = torch.randint(0, config.vocab_size, (n, 1024))
train = [{"input_ids": data[i], "labels": data[i]} for i in range(n)]

trainer = Trainer(
    model=model,
    args=TrainingArguments(
        output_dir="/tmp/gpt2-accum",
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        gradient_checkpointing=True,
        fp16=True,
        max_steps=3,
        save_strategy="no",
        report_to="none",
    ),
    train_dataset=train,
)
trainer.train()
