"""Tiny torch models for the export path (factories referenced as 'tests.tasks.torch_models:NAME')."""
import torch
from torch import nn


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 2, 3, padding=1))
