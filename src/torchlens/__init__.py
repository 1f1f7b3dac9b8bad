"""TorchLens: capture one eager PyTorch forward pass, every op and every module's facets.

The public surface is small:

- [`trace`][torchlens.trace] runs a model once and returns a [`Trace`][torchlens.Trace].
- `trace.ops`, `trace.modules[address].facets[name]`, `trace.output` read what was captured.
- [`torchlens.mechinterp`][torchlens.mechinterp] translates other libraries' hook names to
  TorchLens sites.
- Every deliberate error derives from [`TorchLensError`][torchlens.TorchLensError].
"""

from .errors import (
    AmbiguousModuleCall,
    CaptureError,
    EditSpecError,
    FacetNotFound,
    FacetNotSaved,
    ModuleNotFoundInTrace,
    NotEditable,
    SaveSpecError,
    TorchLensError,
)
from .facets import FACETS
from .records import FacetMap, FacetSite, ModuleCall, ModuleRecord, OpRecord, Trace
from ._persist import TraceFileError, load
from ._store import StoreSpecError
from .tracing import trace

__version__ = "0.1.0"

__all__ = [
    "trace",
    "load",
    "Trace",
    "OpRecord",
    "ModuleRecord",
    "ModuleCall",
    "FacetMap",
    "FacetSite",
    "FACETS",
    "TorchLensError",
    "TraceFileError",
    "StoreSpecError",
    "SaveSpecError",
    "CaptureError",
    "EditSpecError",
    "NotEditable",
    "ModuleNotFoundInTrace",
    "FacetNotFound",
    "FacetNotSaved",
    "AmbiguousModuleCall",
]
