"""Speech recognition fine-tuning (the run_speech_recognition_ctc example's loop, written by hand): Wav2Vec2-base
from its config, 5 s of random 16 kHz audio, CTC labels of 60 characters, AdamW, fp16 autocast with GradScaler,
the feature encoder frozen, batch 8."""

import argparse

import torch
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seconds", type=float, default=5.0)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

config = Wav2Vec2Config(vocab_size=32, ctc_loss_reduction="mean", pad_token_id=0)
model = Wav2Vec2ForCTC(config).cuda()
model.freeze_feature_encoder()
model.train()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
scaler = torch.amp.GradScaler("cuda")
samples = int(16000 * args.seconds)
for step in range(args.steps):
    audio = torch.randn(args.batch_size, samples, device="cuda")
    labels = torch.randint(1, 32, (args.batch_size, 60), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(input_values=audio, labels=labels).loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(step, loss.item())
