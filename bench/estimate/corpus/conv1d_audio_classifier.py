"""Raw-audio keyword spotting (the M5 network of torchaudio's speech-command tutorial, widened): Conv1d stacks with
batch norm and max pooling over 1 s of 16 kHz audio, 35 classes, Adam, fp32, batch 256."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--channels", type=int, default=128)
args = parser.parse_args()


class M5(nn.Module):
    def __init__(self, n_output=35, stride=4, n_channel=128):
        super().__init__()
        self.conv1 = nn.Conv1d(1, n_channel, kernel_size=80, stride=stride)
        self.bn1 = nn.BatchNorm1d(n_channel)
        self.pool1 = nn.MaxPool1d(4)
        self.conv2 = nn.Conv1d(n_channel, n_channel, kernel_size=3)
        self.bn2 = nn.BatchNorm1d(n_channel)
        self.pool2 = nn.MaxPool1d(4)
        self.conv3 = nn.Conv1d(n_channel, 2 * n_channel, kernel_size=3)
        self.bn3 = nn.BatchNorm1d(2 * n_channel)
        self.pool3 = nn.MaxPool1d(4)
        self.conv4 = nn.Conv1d(2 * n_channel, 2 * n_channel, kernel_size=3)
        self.bn4 = nn.BatchNorm1d(2 * n_channel)
        self.pool4 = nn.MaxPool1d(4)
        self.fc1 = nn.Linear(2 * n_channel, n_output)

    def forward(self, x):
        x = self.pool1(F.relu(self.bn1(self.conv1(x))))
        x = self.pool2(F.relu(self.bn2(self.conv2(x))))
        x = self.pool3(F.relu(self.bn3(self.conv3(x))))
        x = self.pool4(F.relu(self.bn4(self.conv4(x))))
        x = F.avg_pool1d(x, x.shape[-1]).squeeze(-1)
        return F.log_softmax(self.fc1(x), dim=-1)


model = M5(n_channel=args.channels).to("cuda")
optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.0001)
for _ in range(4):
    waveform = torch.randn(args.batch_size, 1, 16000, device="cuda")
    target = torch.randint(0, 35, (args.batch_size,), device="cuda")
    loss = F.nll_loss(model(waveform), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(loss.item())
