"""Small CNN: conv-relu-conv-relu-maxpool-linear classifier."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, mid_channels, out_channels, height, width, num_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, mid_channels, 3, padding=1)
        self.conv2 = nn.Conv2d(mid_channels, out_channels, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(out_channels * (height // 2) * (width // 2), num_classes)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = self.pool(x)
        return self.fc(x.flatten(1))


batch_size = 128
in_channels = 3
mid_channels = 64
out_channels = 128
height = 64
width = 64
num_classes = 10


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, mid_channels, out_channels, height, width, num_classes]


SCALES = {"cpu": {"batch_size": 8, "mid_channels": 32, "out_channels": 64, "height": 32, "width": 32}}
