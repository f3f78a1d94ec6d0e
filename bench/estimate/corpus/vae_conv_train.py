"""A convolutional VAE on 128 x 128 images: strided Conv2d encoder with BatchNorm and LeakyReLU, a 256-d latent with
the reparameterization trick, ConvTranspose2d decoder, reconstruction + KL loss, Adam, fp32, batch 128, a DataLoader
over an in-memory TensorDataset with pin_memory."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=128)
args = parser.parse_args()


def down(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 4, 2, 1), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2))


def up(cin, cout):
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, 4, 2, 1), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2))


class VAE(nn.Module):
    def __init__(self, z=256):
        super().__init__()
        self.enc = nn.Sequential(down(3, 64), down(64, 128), down(128, 256), down(256, 512), down(512, 512))
        self.mu = nn.Linear(512 * 4 * 4, z)
        self.logvar = nn.Linear(512 * 4 * 4, z)
        self.fc = nn.Linear(z, 512 * 4 * 4)
        self.dec = nn.Sequential(up(512, 512), up(512, 256), up(256, 128), up(128, 64),
                                 nn.ConvTranspose2d(64, 3, 4, 2, 1))  # fmt: skip

    def forward(self, x):
        h = self.enc(x).flatten(1)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.dec(self.fc(z).view(-1, 512, 4, 4)), mu, logvar


images = torch.rand(args.batch_size * 4, 3, 128, 128)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images), batch_size=args.batch_size,
                                     shuffle=True, pin_memory=True)  # fmt: skip
model = VAE().cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for (x,) in loader:
    x = x.cuda(non_blocking=True)
    recon, mu, logvar = model(x)
    kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
    loss = F.mse_loss(torch.sigmoid(recon), x) + 1e-3 * kl
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(loss.item())
