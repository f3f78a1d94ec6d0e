"""Sequence tagger (NER-style): character-free word embeddings, a 3-layer bidirectional LSTM with
projections (proj_size), a per-token linear head; mixed precision with autocast(float16) and GradScaler,
SGD with momentum, 20 steps of batch 48 x 96."""

import torch
import torch.nn as nn

VOCAB, EMB, HIDDEN, PROJ, TAGS = 20000, 256, 768, 256, 17

model = nn.ModuleDict(
    {
        "embed": nn.Embedding(VOCAB, EMB),
        "lstm": nn.LSTM(EMB, HIDDEN, num_layers=3, bidirectional=True, batch_first=True, proj_size=PROJ),
        "head": nn.Linear(2 * PROJ, TAGS),
    }
).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scaler = torch.amp.GradScaler("cuda")
for _step in range(20):
    words = torch.randint(0, VOCAB, (48, 96), device="cuda")
    tags = torch.randint(0, TAGS, (48, 96), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        states, _ = model["lstm"](model["embed"](words))
        logits = model["head"](states)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tags.flatten())
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("done")
