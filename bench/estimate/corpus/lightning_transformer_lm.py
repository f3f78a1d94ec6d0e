"""A Lightning language model (pytorch_lightning import, as older code writes it): an 8-layer causal
nn.TransformerEncoder of 1024 wide over 32k tokens, AdamW, Trainer(accumulate_grad_batches=2,
gradient_clip_val=1.0, precision="bf16-mixed"), batch 16 x 512."""

import argparse

import pytorch_lightning as pl
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--seq-len", type=int, default=512)
args = parser.parse_args()
V = 32000


class TokenBlocks(torch.utils.data.Dataset):
    def __init__(self):
        self.data = torch.randint(0, V, (args.batch_size * 8, args.seq_len + 1))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


class LitLM(pl.LightningModule):
    def __init__(self, d=1024, layers=8):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(V, d)
        self.pos = nn.Embedding(2048, d)
        layer = nn.TransformerEncoderLayer(d, 16, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, V)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.head(self.blocks(h, mask=mask, is_causal=True))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).view(-1, V), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)


trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=1.0,
                     precision="bf16-mixed", logger=False, enable_checkpointing=False,
                     enable_model_summary=False)  # fmt: skip
trainer.fit(LitLM(), torch.utils.data.DataLoader(TokenBlocks(), batch_size=args.batch_size, shuffle=True))
