"""Semantic segmentation (torchvision's segmentation reference): DeepLabV3-ResNet50 with the auxiliary head, 21
classes, random 480 x 480 crops, SGD with poly LR, ignore_index 255, fp32, batch 8."""

import argparse

import torch
from torchvision.models.segmentation import deeplabv3_resnet50

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--crop", type=int, default=480)
args = parser.parse_args()

model = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=21, aux_loss=True).cuda()
params = [{"params": [p for p in model.backbone.parameters() if p.requires_grad]},
          {"params": [p for p in model.classifier.parameters() if p.requires_grad]},
          {"params": [p for p in model.aux_classifier.parameters() if p.requires_grad], "lr": 0.1}]  # fmt: skip
optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)
scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=100, power=0.9)
criterion = torch.nn.CrossEntropyLoss(ignore_index=255)
for _ in range(3):
    image = torch.randn(args.batch_size, 3, args.crop, args.crop, device="cuda")
    target = torch.randint(0, 21, (args.batch_size, args.crop, args.crop), device="cuda")
    output = model(image)
    loss = criterion(output["out"], target) + 0.5 * criterion(output["aux"], target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
print(loss.item())
