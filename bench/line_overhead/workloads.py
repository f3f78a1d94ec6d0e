"""The three workloads of the line-profiler overhead benchmark: (a) a Python-heavy data-preparation loop,
(b) a small CPU training step, (c) a resnet18 training step on the GPU. Each `make_*` returns
`(step, n_steps)`; `step` is the function that gets profiled."""

from __future__ import annotations

import random


def make_dataprep():
    rng = random.Random(0)
    words = [f"tok{i}" for i in range(2000)]
    texts = [" ".join(rng.choice(words) for _ in range(24)) for _ in range(4000)]
    vocab = {w: i for i, w in enumerate(words)}

    def prepare(texts=texts, vocab=vocab):
        batches = []
        batch = []
        for text in texts:
            tokens = text.lower().split()
            ids = [vocab.get(t, 0) for t in tokens][:16]
            ids += [0] * (16 - len(ids))
            record = {"ids": ids, "len": len(tokens), "first": tokens[0]}
            batch.append(record)
            if len(batch) == 32:
                batches.append(batch)
                batch = []
        return batches

    return prepare, 3


def make_cpu_train():
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(128, 256)
    y = torch.randint(0, 10, (128,))

    def train_step(model=model, opt=opt, x=x, y=y):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()
        return loss.item()

    return train_step, 60


def _resnet18(num_classes=1000):
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            idt = x if self.down is None else self.down(x)
            out = self.relu(self.b1(self.c1(x)))
            return self.relu(self.b2(self.c2(out)) + idt)

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def make_gpu_resnet():
    import torch

    try:
        from torchvision.models import resnet18

        model = resnet18()
    except ImportError:
        model = _resnet18()
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (64,), device="cuda")

    def resnet_step(model=model, opt=opt, x=x, y=y):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        return loss

    return resnet_step, 30


WORKLOADS = {"a_dataprep": make_dataprep, "b_cpu_train": make_cpu_train, "c_gpu_resnet18": make_gpu_resnet}
