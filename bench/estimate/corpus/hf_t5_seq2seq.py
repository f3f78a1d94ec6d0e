"""Translation / summarization with the HF Seq2SeqTrainer (the run_translation example's shape): T5-small from its
config, source 256 and target 64 tokens, batch 32, Adafactor-free AdamW, fp32."""

import argparse

import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--source-len", type=int, default=256)
parser.add_argument("--target-len", type=int, default=64)
args = parser.parse_args()

config = T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, decoder_start_token_id=0)
model = T5ForConditionalGeneration(config)

n = args.batch_size * 4
src = torch.randint(2, config.vocab_size, (n, args.source_len))
tgt = torch.randint(2, config.vocab_size, (n, args.target_len))
train = [{"input_ids": src[i], "attention_mask": torch.ones_like(src[i]), "labels": tgt[i]} for i in range(n)]

trainer = Seq2SeqTrainer(
    model=model,
    args=Seq2SeqTrainingArguments(
        output_dir="/tmp/t5-translation",
        per_device_train_batch_size=args.batch_size,
        max_steps=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to="none",
    ),
    train_dataset=train,
)
trainer.train()
