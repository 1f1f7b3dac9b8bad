"""TorchLens: capture one eager PyTorch forward pass, every op and every module's facets.

The public surface is small:

- [`trace`][torchlens.trace] runs a model once and returns a [`Trace`][torchlens.Trace].
- [`trace_generate`][torchlens.trace_generate] runs a model's own `generate`, every forward call
  traced, and returns a [`GenerationTrace`][torchlens.GenerationTrace] (its `check_decode` holds
  each cached decode step against a full forward).
- `trace.ops`, `trace.modules[address].facets[name]`, `trace.output` read what was captured.
- [`torchlens.mechinterp`][torchlens.mechinterp] translates other libraries' hook names to
  TorchLens sites.
- Every deliberate error derives from [`TorchLensError`][torchlens.TorchLensError].
- `torchlens.testing` (imported on its own, `from torchlens import testing`) builds the tiny seeded
  models the tests, the docs and an engine's CI use, and reads ground truth with plain forward hooks.

Everything public is importable from here (or from `torchlens.mechinterp`); the modules behind
it are underscore-named and may change without notice.
"""

from torchlens._analysis.structure import Layer, Stack, Structure
from torchlens._capture.stores import StoreSpecError
from torchlens._core.errors import (
    AmbiguousModuleCall,
    CaptureError,
    EditSpecError,
    FacetNotFound,
    FacetNotSaved,
    GenerateSpecError,
    GradientError,
    GradNotFound,
    GradNotSaved,
    LookupFailed,
    ModuleNotFoundInTrace,
    NoGradients,
    NotEditable,
    RoleSpecError,
    SaveSpecError,
    TorchLensError,
)
from torchlens._core.facet_spec import FACETS
from torchlens._core.grad_sites import GradMap
from torchlens._core.records import ModuleCall, ModuleMap, ModuleRecord, OpRecord, Ref
from torchlens._core.sites import FacetMap, FacetSite
from torchlens._core.version import __version__ as __version__
from torchlens._draw import Drawing
from torchlens._edits import EditRecord
from torchlens._generation.decode_report import DecodeReport, DecodeRow, StepVerdict
from torchlens._generation.generate import trace_generate
from torchlens._generation.result import GenerationTrace, StepInfo
from torchlens._persist import TraceFileError, load
from torchlens._trace import Trace
from torchlens._tracing import trace

__all__ = [
    "trace",
    "trace_generate",
    "load",
    "Trace",
    "GenerationTrace",
    "StepInfo",
    "DecodeReport",
    "DecodeRow",
    "StepVerdict",
    "OpRecord",
    "Ref",
    "ModuleMap",
    "ModuleRecord",
    "ModuleCall",
    "FacetMap",
    "FacetSite",
    "GradMap",
    "Structure",
    "Stack",
    "Layer",
    "EditRecord",
    "Drawing",
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
    "GenerateSpecError",
    "ModuleNotFoundInTrace",
    "FacetNotFound",
    "FacetNotSaved",
    "AmbiguousModuleCall",
    "GradientError",
    "NoGradients",
    "GradNotFound",
    "GradNotSaved",
]
