"""nanoGPT's train.py loop with torch.compile (nanoGPT's default compile=True): a GPT of 12 layers, 12 heads,
768 wide, block 1024 written as nanoGPT writes it (flash attention via scaled_dot_product_attention, weight
tying), fused AdamW with decayed and non-decayed groups, bf16 autocast, gradient accumulation over 2 micro-steps,
clip_grad_norm_ 1.0, batch 12."""

import argparse
import math

import torch
import torch.nn as nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=12)
parser.add_argument("--block-size", type=int, default=1024)
parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
args = parser.parse_args()


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


device = "cuda"
torch.backends.cuda.matmul.allow_tf32 = True
model = GPT(block_size=args.block_size).to(device)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=6e-4, betas=(0.9, 0.95), fused=True)  # fmt: skip
if args.compile:
    model = torch.compile(model)
scaler = torch.amp.GradScaler("cuda", enabled=False)  # bf16 needs no scaling; nanoGPT keeps the scaler anyway


def get_batch():
    x = torch.randint(50257, (args.batch_size, args.block_size)).pin_memory().to(device, non_blocking=True)
    y = torch.randint(50257, (args.batch_size, args.block_size)).pin_memory().to(device, non_blocking=True)
    return x, y


X, Y = get_batch()
for it in range(3):
    lr = 6e-4 * 0.5 * (1.0 + math.cos(math.pi * it / 100))
    for group in optimizer.param_groups:
        group["lr"] = lr
    for _micro in range(args.gradient_accumulation_steps):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits, loss = model(X, Y)
            loss = loss / args.gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(f"iter {it}: loss {loss.item() * args.gradient_accumulation_steps:.4f}")
