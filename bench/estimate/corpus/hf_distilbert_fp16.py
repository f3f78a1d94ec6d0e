"""Sentiment classification with the HF Trainer and fp16 mixed precision: DistilBERT from its config, 2 labels,
batch 64 x 256 tokens, a warmup linear schedule, weight decay."""

import argparse

import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--seq-len", type=int, default=256)
args = parser.parse_args()

config = DistilBertConfig(num_labels=2)
model = DistilBertForSequenceClassification(config)

n = args.batch_size * 5
ids = torch.randint(0, config.vocab_size, (n, args.seq_len))
labels = torch.randint(0, 2, (n,))
train = [{"input_ids": ids[i], "attention_mask": torch.ones(args.seq_len, dtype=torch.long), "labels": labels[i]}
         for i in range(n)]  # fmt: skip

trainer = Trainer(
    model=model,
    args=TrainingArguments(
        output_dir="/tmp/distilbert-sst2",
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=1,
        max_steps=5,
        fp16=True,
        learning_rate=5e-5,
        weight_decay=0.01,
        warmup_steps=2,
        save_strategy="no",
        report_to="none",
        logging_steps=5,
    ),
    train_dataset=train,
)
trainer.train()
