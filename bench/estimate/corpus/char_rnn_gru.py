"""Character-level language model (char-rnn's shape): embedding, a 3-layer GRU of 1024 with dropout, batch-first
input, batch 128 x 256 characters, truncated BPTT with the hidden state carried and detached, Adam, fp32."""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--seq-len", type=int, default=256)
parser.add_argument("--hidden", type=int, default=1024)
args = parser.parse_args()


class CharRNN(nn.Module):
    def __init__(self, vocab=256, hidden=1024, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, 128)
        self.gru = nn.GRU(128, hidden, layers, batch_first=True, dropout=0.3)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x, h=None):
        out, h = self.gru(self.embed(x), h)
        return self.head(out), h


model = CharRNN(hidden=args.hidden).cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
h = None
text = torch.randint(0, 256, (args.batch_size, args.seq_len * 5 + 1))
for i in range(5):
    chunk = text[:, i * args.seq_len : (i + 1) * args.seq_len + 1].cuda()
    logits, h = model(chunk[:, :-1], h)
    h = h.detach()
    loss = nn.functional.cross_entropy(logits.reshape(-1, 256), chunk[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    optimizer.step()
print(loss.item())
