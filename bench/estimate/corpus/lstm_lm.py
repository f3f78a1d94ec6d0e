"""Word-level LSTM language model (the PyTorch word_language_model example's shape): embedding, 2-layer LSTM
with dropout, tied-size decoder, Adam, gradient clipping, 20 steps of batch 32 x 128 tokens."""

import torch
import torch.nn as nn

VOCAB, EMB, HIDDEN, LAYERS = 10000, 512, 1024, 2


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(VOCAB, EMB)
        self.rnn = nn.LSTM(EMB, HIDDEN, LAYERS, dropout=0.2)
        self.decoder = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, hidden):
        out, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(out)), hidden


device = torch.device("cuda")
model = LanguageModel().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss()
hidden = None
for _step in range(20):
    data = torch.randint(0, VOCAB, (128, 32), device=device)
    target = torch.randint(0, VOCAB, (128 * 32,), device=device)
    if hidden is not None:
        hidden = tuple(h.detach() for h in hidden)
    output, hidden = model(data, hidden)
    loss = criterion(output.view(-1, VOCAB), target)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    optimizer.step()
print(f"loss {loss.item():.3f}")
