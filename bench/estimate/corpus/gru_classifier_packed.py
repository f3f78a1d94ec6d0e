"""Text classifier on variable-length sentences: a bidirectional GRU over packed sequences
(pack_padded_sequence), the last hidden states of both directions into a linear head; AdamW, 20 steps."""

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence

VOCAB, EMB, HIDDEN, CLASSES, BATCH, MAX_LEN = 30000, 300, 512, 5, 64, 200


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMB, padding_idx=0)
        self.gru = nn.GRU(EMB, HIDDEN, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * HIDDEN, CLASSES)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return self.head(torch.cat([h[-2], h[-1]], dim=1))


model = Classifier().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
gen = torch.Generator().manual_seed(0)
for _step in range(20):
    lengths = torch.randint(20, MAX_LEN + 1, (BATCH,), generator=gen)
    lengths[0] = MAX_LEN
    tokens = torch.randint(1, VOCAB, (BATCH, MAX_LEN), generator=gen).cuda()
    labels = torch.randint(0, CLASSES, (BATCH,), generator=gen).cuda()
    loss = nn.functional.cross_entropy(model(tokens, lengths), labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
print("done", loss.item())
