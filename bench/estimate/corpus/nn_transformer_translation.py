"""Translation with nn.Transformer (the "Attention is all you need" base model as the PyTorch tutorial builds it):
6+6 layers, d_model 512, causal and padding masks, shared-size vocabularies of 32k, label smoothing 0.1, Adam with
the inverse-square-root warmup (LambdaLR), batch 64 x 128 tokens, bf16 autocast."""

import argparse
import math

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--seq-len", type=int, default=128)
args = parser.parse_args()
V, D = 32000, 512


class Translator(nn.Module):
    def __init__(self):
        super().__init__()
        self.src_tok = nn.Embedding(V, D)
        self.tgt_tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(512, D)
        self.transformer = nn.Transformer(D, 8, 6, 6, 2048, 0.1, batch_first=True)
        self.generator = nn.Linear(D, V)

    def embed(self, table, ids):
        return table(ids) * math.sqrt(D) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, src, tgt, src_pad, tgt_pad):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        out = self.transformer(self.embed(self.src_tok, src), self.embed(self.tgt_tok, tgt), tgt_mask=causal,
                               src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                               memory_key_padding_mask=src_pad)  # fmt: skip
        return self.generator(out)


model = Translator().cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: D**-0.5 * min((s + 1) ** -0.5, (s + 1) * 4000**-1.5))
criterion = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
for _ in range(4):
    src = torch.randint(1, V, (args.batch_size, args.seq_len), device="cuda")
    tgt = torch.randint(1, V, (args.batch_size, args.seq_len + 1), device="cuda")
    src_pad = src == 0
    tgt_pad = tgt[:, :-1] == 0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(src, tgt[:, :-1], src_pad, tgt_pad)
        loss = criterion(logits.reshape(-1, V), tgt[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
print(loss.item())
