"""TorchLens: capture one eager PyTorch forward pass, every op and every module's facets."""

__version__ = "0.1.0"
