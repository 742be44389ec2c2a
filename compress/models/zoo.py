"""Small reference models for `module:factory` sources (digits, tests)."""

from __future__ import annotations

from torch import nn


def small_cnn(num_classes: int = 10, channels: int = 32, in_channels: int = 1) -> nn.Module:
    """A two-block CNN for 8x8 images (scikit-learn digits)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * channels * 16, 128), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(128, num_classes),
    )


def mlp(in_features: int = 64, hidden: int = 64, num_classes: int = 10) -> nn.Module:
    """A two-layer perceptron over flattened inputs."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))
