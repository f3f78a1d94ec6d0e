"""A DLRM-style click-through-rate model: 8 dense embedding tables (nn.Embedding, sparse=False) of 1M rows x 128,
two multi-hot features through nn.EmbeddingBag(mode="sum") with offsets, bottom and top MLPs, pairwise dot
interactions, BCE loss, Adagrad (the recommender default), batch 8192, fp32."""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8192)
parser.add_argument("--rows", type=int, default=1_000_000)
parser.add_argument("--dim", type=int, default=128)
args = parser.parse_args()
N_SPARSE, N_BAG, HOTNESS = 8, 2, 20


class DLRM(nn.Module):
    def __init__(self, rows, dim):
        super().__init__()
        self.tables = nn.ModuleList([nn.Embedding(rows, dim) for _ in range(N_SPARSE)])
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows // 4, dim, mode="sum") for _ in range(N_BAG)])
        self.bottom = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, dim))
        n = N_SPARSE + N_BAG + 1
        self.top = nn.Sequential(nn.Linear(n * (n - 1) // 2 + dim, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                 nn.ReLU(), nn.Linear(1024, 1))  # fmt: skip

    def forward(self, dense, sparse, bag_ids, bag_offsets):
        x = self.bottom(dense)
        feats = [x] + [t(sparse[:, i]) for i, t in enumerate(self.tables)]
        feats += [b(bag_ids[j], bag_offsets) for j, b in enumerate(self.bags)]
        z = torch.stack(feats, dim=1)
        inter = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1, device=z.device)
        return self.top(torch.cat([x, inter[:, i, j]], dim=1)).squeeze(1)


model = DLRM(args.rows, args.dim).cuda()
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)
loss_fn = nn.BCEWithLogitsLoss()
offsets = torch.arange(0, args.batch_size * HOTNESS, HOTNESS, device="cuda")
for _ in range(4):
    dense = torch.randn(args.batch_size, 13, device="cuda")
    sparse = torch.randint(0, args.rows, (args.batch_size, N_SPARSE), device="cuda")
    bag_ids = torch.randint(0, args.rows // 4, (N_BAG, args.batch_size * HOTNESS), device="cuda")
    clicks = torch.randint(0, 2, (args.batch_size,), device="cuda").float()
    loss = loss_fn(model(dense, sparse, bag_ids, offsets), clicks)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(loss.item())
