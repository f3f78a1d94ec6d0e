"""Causal language modelling with the HF Trainer (the run_clm example's shape): GPT-2 small from its config,
blocks of 512 tokens, batch 8, fp32, AdamW, cosine schedule."""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--block-size", type=int, default=512)
args = parser.parse_args()


class Blocks(torch.utils.data.Dataset):
    def __init__(self, n, block_size):
        self.data = torch.randint(0, 50257, (n, block_size))

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i].clone()}


model = GPT2LMHeadModel(GPT2Config())
trainer = Trainer(
    model=model,
    args=TrainingArguments(
        output_dir="/tmp/gpt2-clm",
        per_device_train_batch_size=args.batch_size,
        max_steps=4,
        lr_scheduler_type="cosine",
        learning_rate=3e-4,
        save_strategy="no",
        report_to="none",
    ),
    train_dataset=Blocks(args.batch_size * 4, args.block_size),
)
trainer.train()
