"""Data modules: images in [0, 1], integer labels; normalisation happens inside the model."""
from .base import ImageDataModule
from .cifar import CIFAR10, CIFAR100
from .digits import Digits
from .folder import ImageFolder
from .mnist import MNIST, FashionMNIST

__all__ = ["CIFAR10", "CIFAR100", "Digits", "FashionMNIST", "ImageDataModule", "ImageFolder", "MNIST"]
