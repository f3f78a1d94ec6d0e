"""ImageNet-style validation loop (no optimizer): torchvision ResNet-50 in channels_last, fp16 autocast,
torch.inference_mode, a DataLoader with pin_memory and 2 workers, top-1 accuracy via .item(), batch 256."""

import argparse

import torch
import torchvision

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--batches", type=int, default=4)
args = parser.parse_args()


class FakeImageNet(torch.utils.data.Dataset):
    def __len__(self):
        return args.batch_size * args.batches

    def __getitem__(self, i):
        return torch.randn(3, 224, 224), i % 1000


loader = torch.utils.data.DataLoader(FakeImageNet(), batch_size=args.batch_size, num_workers=2, pin_memory=True)
model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last).eval()
correct = total = 0
with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
    for images, targets in loader:
        images = images.cuda(non_blocking=True).to(memory_format=torch.channels_last)
        targets = targets.cuda(non_blocking=True)
        pred = model(images).argmax(1)
        correct += (pred == targets).sum().item()
        total += targets.numel()
print(f"top1 {100 * correct / total:.2f}")
