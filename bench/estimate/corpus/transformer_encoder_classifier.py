"""Document classification with nn.TransformerEncoder (which deep-copies its layer), built on the CPU and then
moved: 12 layers, d_model 768, pre-norm, GELU, a padding mask, mean pooling, AdamW with a OneCycle schedule,
batch 64 x 512 tokens, fp32."""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--seq-len", type=int, default=512)
args = parser.parse_args()


class Classifier(nn.Module):
    def __init__(self, vocab=30000, d=768, layers=12, classes=20):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, 1024, d))
        layer = nn.TransformerEncoderLayer(d, 12, 4 * d, dropout=0.1, activation="gelu", batch_first=True,
                                           norm_first=True)  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids, pad_mask):
        x = self.embed(ids) + self.pos[:, : ids.shape[1]]
        x = self.encoder(x, src_key_padding_mask=pad_mask)
        keep = (~pad_mask).unsqueeze(-1).float()
        return self.head((x * keep).sum(1) / keep.sum(1).clamp(min=1))


model = Classifier().to("cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-4, total_steps=100)
for _ in range(4):
    ids = torch.randint(1, 30000, (args.batch_size, args.seq_len), device="cuda")
    pad_mask = torch.zeros(args.batch_size, args.seq_len, dtype=torch.bool, device="cuda")
    pad_mask[:, -32:] = True
    labels = torch.randint(0, 20, (args.batch_size,), device="cuda")
    loss = nn.functional.cross_entropy(model(ids, pad_mask), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
print(loss.item())
