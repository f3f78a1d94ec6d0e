"""Two-tower retrieval with in-batch negatives: a user tower over an id embedding and a bag of watched items
(EmbeddingBag, mean, padding by per-sample offsets), an item tower over 2M item embeddings, cosine similarity
logits over the batch, Adam, batch 4096, fp32."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=4096)
parser.add_argument("--history", type=int, default=50)
args = parser.parse_args()
USERS, ITEMS, DIM = 1_000_000, 2_000_000, 256

user_emb = nn.Embedding(USERS, DIM)
history_bag = nn.EmbeddingBag(ITEMS, DIM, mode="mean")
item_emb = nn.Embedding(ITEMS, DIM)
user_mlp = nn.Sequential(nn.Linear(2 * DIM, 512), nn.ReLU(), nn.Linear(512, DIM))
item_mlp = nn.Sequential(nn.Linear(DIM, 512), nn.ReLU(), nn.Linear(512, DIM))
modules = nn.ModuleList([user_emb, history_bag, item_emb, user_mlp, item_mlp]).cuda()
optimizer = torch.optim.Adam(modules.parameters(), lr=1e-3)

for _ in range(4):
    users = torch.randint(0, USERS, (args.batch_size,), device="cuda")
    history = torch.randint(0, ITEMS, (args.batch_size * args.history,), device="cuda")
    offsets = torch.arange(0, args.batch_size * args.history, args.history, device="cuda")
    positives = torch.randint(0, ITEMS, (args.batch_size,), device="cuda")
    u = user_mlp(torch.cat([user_emb(users), history_bag(history, offsets)], dim=1))
    v = item_mlp(item_emb(positives))
    logits = F.normalize(u, dim=-1) @ F.normalize(v, dim=-1).T / 0.05
    loss = F.cross_entropy(logits, torch.arange(args.batch_size, device="cuda"))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(loss.item())
