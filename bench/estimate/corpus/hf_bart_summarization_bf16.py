"""Summarization fine-tuning with the HF Seq2SeqTrainer and bf16: BART-base from its config, articles of 512
tokens, summaries of 128, batch 16, label smoothing 0.1 (the Trainer then takes the labels out of the model's
inputs, so the decoder inputs come with the batch, as DataCollatorForSeq2Seq(model=...) makes them)."""

import argparse

import torch
from transformers import BartConfig, BartForConditionalGeneration, Seq2SeqTrainer, Seq2SeqTrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--max-source-length", type=int, default=512)
parser.add_argument("--max-target-length", type=int, default=128)
args = parser.parse_args()


class Articles(torch.utils.data.Dataset):
    def __len__(self):
        return args.batch_size * 4

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        labels = torch.randint(4, 50265, (args.max_target_length,), generator=g)
        return {
            "input_ids": torch.randint(4, 50265, (args.max_source_length,), generator=g),
            "attention_mask": torch.ones(args.max_source_length, dtype=torch.long),
            "labels": labels,
            "decoder_input_ids": torch.cat([torch.tensor([2]), labels[:-1]]),  # shift_tokens_right
        }


model = BartForConditionalGeneration(BartConfig())
trainer = Seq2SeqTrainer(
    model=model,
    args=Seq2SeqTrainingArguments(
        output_dir="/tmp/bart-cnn",
        per_device_train_batch_size=args.batch_size,
        max_steps=4,
        bf16=True,
        label_smoothing_factor=0.1,
        learning_rate=3e-5,
        save_strategy="no",
        report_to="none",
    ),
    train_dataset=Articles(),
)
trainer.train()
