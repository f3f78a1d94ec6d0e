"""Masked language modelling with the HF Trainer (run_mlm's shape): RoBERTa-base from its config, 15 % of the
tokens masked by hand (no tokenizer offline), labels -100 elsewhere, batch 32 x 512, bf16."""

import argparse

import torch
from transformers import RobertaConfig, RobertaForMaskedLM, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--seq-len", type=int, default=512)
args = parser.parse_args()

config = RobertaConfig(vocab_size=50265, max_position_embeddings=514)
model = RobertaForMaskedLM(config)


def make_example(i):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(5, config.vocab_size, (args.seq_len,), generator=g)
    mask = torch.rand(args.seq_len, generator=g) < 0.15
    labels = torch.where(mask, ids, torch.full_like(ids, -100))
    ids = torch.where(mask, torch.full_like(ids, 4), ids)  # <mask>
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


train = [make_example(i) for i in range(args.batch_size * 4)]
trainer = Trainer(
    model=model,
    args=TrainingArguments(
        output_dir="/tmp/roberta-mlm",
        per_device_train_batch_size=args.batch_size,
        max_steps=4,
        bf16=True,
        learning_rate=1e-4,
        save_strategy="no",
        report_to="none",
    ),
    train_dataset=train,
)
trainer.train()
