"""Batch transcription with Whisper (greedy decoding, no optimizer): Whisper-base from its config in fp16, 30 s of
random audio features per item, batch 32, max_new_tokens 48."""

import argparse

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--max-new-tokens", type=int, default=48)
args = parser.parse_args()

config = WhisperConfig(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                       decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048)  # fmt: skip
model = WhisperForConditionalGeneration(config).to("cuda", torch.float16).eval()
features = torch.randn(args.batch_size, 80, 3000, device="cuda", dtype=torch.float16)
with torch.no_grad():
    tokens = model.generate(input_features=features, max_new_tokens=args.max_new_tokens, do_sample=False)
print(tokens.shape)
