"""Names other interpretability libraries use, translated to TorchLens sites.

- [`resolve_alias`][torchlens.mechinterp.resolve_alias]`(trace, name)`: one name to its site.
- [`alias_report`][torchlens.mechinterp.alias_report]`(trace, generation=...)`: every name of a
  generation, instantiated on a trace, with an honest status.
- `GENERATIONS`: the tables, one per naming generation (`"2.x"`, `"3.x"`, `"4.x"`, `"nnterp"`,
  `"interp-engine"`). A `Table` is checked against the facet specification and the targets
  when it is built; a bad row raises `TableError`.
- [`compare`][torchlens.mechinterp.compare]`(trace, {name: tensor})`: check another
  engine's tensors against the trace, converting layouts, with a hint for each mismatch. It
  returns a [`ComparisonReport`][torchlens.mechinterp.ComparisonReport]; `tolerance=` errors
  are [`ToleranceError`][torchlens.mechinterp.ToleranceError]s. With `of="grad"` it checks
  gradients against a trace taken with `grads=`; a bad `of=` is a
  [`CompareSpecError`][torchlens.mechinterp.CompareSpecError].

`torchlens.mechinterp.compare` is the function; the code behind it lives in an internal
module, so no submodule shares its name.
"""

from torchlens._naming.diagnose import Candidate
from torchlens._naming.resolver import GENERATIONS, alias_report, resolve_alias, table
from torchlens._naming.results import (
    STATUSES,
    AliasError,
    AliasReport,
    AliasResolution,
    LayerOutOfRange,
    MalformedAlias,
    UnknownAlias,
    UnknownGeneration,
)
from torchlens._naming.tables import Row, Table, TableError
from torchlens.mechinterp._compare import CompareSpecError, ToleranceError, compare
from torchlens.mechinterp._comparison import Comparison, ComparisonReport
from torchlens.mechinterp._translate import (
    TRANSLATION_STATUSES,
    Translation,
    UnknownFamily,
    translate,
)

__all__ = [
    "resolve_alias",
    "alias_report",
    "table",
    "translate",
    "Translation",
    "TRANSLATION_STATUSES",
    "UnknownFamily",
    "compare",
    "Comparison",
    "ComparisonReport",
    "ToleranceError",
    "CompareSpecError",
    "Candidate",
    "AliasResolution",
    "AliasReport",
    "GENERATIONS",
    "STATUSES",
    "Row",
    "Table",
    "TableError",
    "AliasError",
    "UnknownAlias",
    "UnknownGeneration",
    "LayerOutOfRange",
    "MalformedAlias",
]
