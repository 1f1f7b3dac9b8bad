"""The leaf layer: records, facets, pending checks, where a trace holds tensors, errors, and the
knowledge read as data (op kinds, role hints, facet rows). It imports torch and `_core` only."""
