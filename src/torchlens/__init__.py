"""TorchLens: capture one eager PyTorch forward pass, every op and every module's facets.

The public surface is small:

- [`trace`][torchlens.trace] runs a model once and returns a [`Trace`][torchlens.Trace].
- `trace.ops`, `trace.modules[address].facets[name]`, `trace.output` read what was captured.
- [`torchlens.mechinterp`][torchlens.mechinterp] translates other libraries' hook names to
  TorchLens sites.
- Every deliberate error derives from [`TorchLensError`][torchlens.TorchLensError].
- `torchlens.testing` (imported on its own, `from torchlens import testing`) builds the tiny seeded
  models the tests, the docs and an engine's CI use, and reads ground truth with plain forward hooks.

Everything public is importable from here (or from `torchlens.mechinterp`); the modules behind
it are underscore-named and may change without notice.
"""

from ._edits import EditRecord
from ._errors import (
    AmbiguousModuleCall,
    CaptureError,
    EditSpecError,
    FacetNotFound,
    FacetNotSaved,
    LookupFailed,
    ModuleNotFoundInTrace,
    NotEditable,
    RoleSpecError,
    SaveSpecError,
    TorchLensError,
)
from ._facet_spec import FACETS
from ._persist import TraceFileError, load
from ._records import FacetMap, FacetSite, ModuleCall, ModuleMap, ModuleRecord, OpRecord, Ref, Trace
from ._store import StoreSpecError
from ._structure import Layer, Stack, Structure
from ._tracing import trace

__version__ = "0.1.0"

__all__ = [
    "trace",
    "load",
    "Trace",
    "OpRecord",
    "Ref",
    "ModuleMap",
    "ModuleRecord",
    "ModuleCall",
    "FacetMap",
    "FacetSite",
    "Structure",
    "Stack",
    "Layer",
    "EditRecord",
    "FACETS",
    "TorchLensError",
    "LookupFailed",
    "TraceFileError",
    "StoreSpecError",
    "SaveSpecError",
    "RoleSpecError",
    "CaptureError",
    "EditSpecError",
    "NotEditable",
    "ModuleNotFoundInTrace",
    "FacetNotFound",
    "FacetNotSaved",
    "AmbiguousModuleCall",
]
