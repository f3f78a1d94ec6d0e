"""DDPM training of a small diffusion UNet written by hand (the usual tutorial shape, no diffusers): residual blocks
with GroupNorm and SiLU, sinusoidal timestep embeddings, self-attention at 16 x 16, strided-conv downsampling and
ConvTranspose2d upsampling, noise-prediction MSE loss, AdamW, fp16 autocast with GradScaler, batch 64 at 64 x 64."""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--image-size", type=int, default=64)
parser.add_argument("--base-channels", type=int, default=128)
args = parser.parse_args()


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    angles = t[:, None].float() * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.norm1 = nn.GroupNorm(32, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.norm2 = nn.GroupNorm(32, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, t):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(t)[:, :, None, None]
        h = self.conv2(F.dropout(F.silu(self.norm2(h)), 0.1, self.training))
        return h + self.skip(x)


class Attention(nn.Module):
    def __init__(self, ch, heads=4):
        super().__init__()
        self.norm = nn.GroupNorm(32, ch)
        self.qkv = nn.Conv2d(ch, 3 * ch, 1)
        self.proj = nn.Conv2d(ch, ch, 1)
        self.heads = heads

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, self.heads, c // self.heads, h * w).unbind(1)
        out = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return x + self.proj(out.transpose(-1, -2).reshape(b, c, h, w))


class UNet(nn.Module):
    def __init__(self, ch=128, mults=(1, 2, 2, 4)):
        super().__init__()
        tdim = ch * 4
        self.ch = ch
        self.time = nn.Sequential(nn.Linear(ch, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.down, self.up = nn.ModuleList(), nn.ModuleList()
        chans, c = [ch], ch
        for i, m in enumerate(mults):
            blocks = nn.ModuleList([ResBlock(c, ch * m, tdim), ResBlock(ch * m, ch * m, tdim)])
            c = ch * m
            attn = Attention(c) if i == 1 else nn.Identity()
            down = nn.Conv2d(c, c, 3, stride=2, padding=1) if i < len(mults) - 1 else nn.Identity()
            self.down.append(nn.ModuleList([blocks, attn, down]))
            chans.append(c)
        self.mid1, self.mid_attn, self.mid2 = ResBlock(c, c, tdim), Attention(c), ResBlock(c, c, tdim)
        for i, m in reversed(list(enumerate(mults))):
            skip = chans.pop()
            blocks = nn.ModuleList([ResBlock(c + skip, ch * m, tdim), ResBlock(ch * m, ch * m, tdim)])
            c = ch * m
            attn = Attention(c) if i == 1 else nn.Identity()
            up = nn.ConvTranspose2d(c, c, 4, stride=2, padding=1) if i > 0 else nn.Identity()
            self.up.append(nn.ModuleList([blocks, attn, up]))
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def forward(self, x, t):
        temb = self.time(timestep_embedding(t, self.ch))
        h = self.inp(x)
        skips = []
        for blocks, attn, down in self.down:
            for b in blocks:
                h = b(h, temb)
            h = attn(h)
            skips.append(h)
            h = down(h)
        h = self.mid2(self.mid_attn(self.mid1(h, temb)), temb)
        for blocks, attn, up in self.up:
            h = torch.cat([h, skips.pop()], dim=1)
            for b in blocks:
                h = b(h, temb)
            h = up(attn(h))
        return self.out(h)


T = 1000
betas = torch.linspace(1e-4, 0.02, T, device="cuda")
alphas_bar = torch.cumprod(1 - betas, dim=0)
model = UNet(args.base_channels).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4)
scaler = torch.amp.GradScaler("cuda")
for _step in range(4):
    x0 = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device="cuda")
    t = torch.randint(0, T, (args.batch_size,), device="cuda")
    noise = torch.randn_like(x0)
    a = alphas_bar[t].view(-1, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.mse_loss(model(xt, t), noise)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
print(f"loss {loss.item():.4f}")
