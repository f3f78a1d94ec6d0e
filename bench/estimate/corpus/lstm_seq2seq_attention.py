"""Neural machine translation with LSTMs (the Luong-attention tutorial shape): a bidirectional 2-layer LSTM
encoder, a 2-layer LSTM decoder run over the whole target with teacher forcing, dot-product attention over the
encoder states, vocabularies of 16k, batch 64 x 80 tokens, Adam, fp16 autocast with GradScaler."""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--src-len", type=int, default=80)
parser.add_argument("--tgt-len", type=int, default=80)
args = parser.parse_args()
V, E, H = 16000, 512, 512


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.src_emb = nn.Embedding(V, E)
        self.tgt_emb = nn.Embedding(V, E)
        self.encoder = nn.LSTM(E, H, 2, bidirectional=True, batch_first=True, dropout=0.2)
        self.bridge = nn.Linear(2 * H, H)
        self.decoder = nn.LSTM(E, H, 2, batch_first=True, dropout=0.2)
        self.out = nn.Linear(2 * H, V)

    def forward(self, src, tgt):
        enc, _ = self.encoder(self.src_emb(src))
        enc = self.bridge(enc)
        dec, _ = self.decoder(self.tgt_emb(tgt))
        attn = torch.softmax(dec @ enc.transpose(1, 2), dim=-1)
        return self.out(torch.cat([dec, attn @ enc], dim=-1))


model = Seq2Seq().cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
criterion = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
for _ in range(4):
    src = torch.randint(1, V, (args.batch_size, args.src_len), device="cuda")
    tgt = torch.randint(1, V, (args.batch_size, args.tgt_len + 1), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(src, tgt[:, :-1])
        loss = criterion(logits.reshape(-1, V), tgt[:, 1:].reshape(-1))
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
print(loss.item())
