"""Text classification with the HF Trainer (the run_glue example's shape): BERT-base from its config, 3 labels,
synthetic token ids in a tiny in-memory Dataset, AdamW (the Trainer's default), fp32, batch 32 x 128."""

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--seq-len", type=int, default=128)
parser.add_argument("--max-steps", type=int, default=4)
args = parser.parse_args()


class SyntheticGlue(torch.utils.data.Dataset):
    def __init__(self, n, seq_len, vocab):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, vocab, (n, seq_len), generator=g)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


config = BertConfig(num_labels=3)
model = BertForSequenceClassification(config)
train = SyntheticGlue(args.batch_size * args.max_steps, args.seq_len, config.vocab_size)
training_args = TrainingArguments(
    output_dir="/tmp/bert-glue",
    per_device_train_batch_size=args.batch_size,
    learning_rate=2e-5,
    max_steps=args.max_steps,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
)
trainer = Trainer(model=model, args=training_args, train_dataset=train)
trainer.train()
