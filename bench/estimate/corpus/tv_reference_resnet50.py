"""torchvision's classification reference recipe (references/classification/train.py): ResNet-50, SGD momentum
0.9, weight decay 1e-4, label smoothing 0.1, AMP with GradScaler, cosine LR with linear warmup, a DataLoader with
pin_memory and 2 workers, batch 128."""

import argparse

import torch
import torchvision

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--lr", type=float, default=0.5)
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--amp", action="store_true", default=True)
args = parser.parse_args()


class RandomImageFolder(torch.utils.data.Dataset):
    def __len__(self):
        return args.batch_size * 4

    def __getitem__(self, idx):
        return torch.randn(3, 224, 224), idx % 1000


device = torch.device("cuda")
data_loader = torch.utils.data.DataLoader(RandomImageFolder(), batch_size=args.batch_size, shuffle=True,
                                          num_workers=args.workers, pin_memory=True, drop_last=True)  # fmt: skip
model = torchvision.models.resnet50(weights=None).to(device)
criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
scaler = torch.amp.GradScaler("cuda") if args.amp else None
main_lr = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=5)
lr_scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, main_lr], milestones=[5])

model.train()
for image, target in data_loader:
    image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
    with torch.autocast("cuda", enabled=scaler is not None):
        output = model(image)
        loss = criterion(output, target)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    lr_scheduler.step()
    acc1 = (output.argmax(1) == target).float().mean().item()
print(loss.item(), acc1)
