"""The version of TorchLens (read by the build backend, `torchlens.__version__` and saved traces)."""

__version__ = "0.1.0"
