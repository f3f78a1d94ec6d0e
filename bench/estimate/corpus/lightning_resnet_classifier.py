"""A LightningModule image classifier run by Lightning's Trainer.fit: torchvision ResNet-34, SGD with a cosine
schedule from configure_optimizers, precision "16-mixed", a DataLoader with pin_memory and 2 workers, batch 128,
a few steps (max_steps), no logger and no checkpoints."""

import argparse

import lightning as L
import torch
import torchvision

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--max-steps", type=int, default=5)
args = parser.parse_args()


class RandomImages(torch.utils.data.Dataset):
    def __len__(self):
        return args.batch_size * args.max_steps

    def __getitem__(self, i):
        return torch.randn(3, 224, 224), i % 1000


class LitResNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = torchvision.models.resnet34()
        self.criterion = torch.nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.criterion(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        return [opt], [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.max_steps)]


loader = torch.utils.data.DataLoader(RandomImages(), batch_size=args.batch_size, shuffle=True, num_workers=2,
                                     pin_memory=True)  # fmt: skip
trainer = L.Trainer(accelerator="gpu", devices=1, precision="16-mixed", max_steps=args.max_steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
trainer.fit(LitResNet(), loader)
