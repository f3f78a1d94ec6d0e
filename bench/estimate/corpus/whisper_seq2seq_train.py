"""Whisper fine-tuning (the Seq2SeqTrainer speech example's loop, by hand): Whisper-small from its config, 30 s
log-mel features (80 x 3000) of random audio, transcripts of 128 tokens, AdamW, bf16 autocast, batch 16."""

import argparse

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--label-len", type=int, default=128)
args = parser.parse_args()

config = WhisperConfig(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
                       decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)  # fmt: skip
model = WhisperForConditionalGeneration(config).to("cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
for step in range(3):
    features = torch.randn(args.batch_size, 80, 3000, device="cuda")
    labels = torch.randint(0, config.vocab_size, (args.batch_size, args.label_len), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(input_features=features, labels=labels)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {out.loss.item():.3f}")
