"""Finders: where a target (a key of `_naming.targets.TARGETS`) is in a given trace, one module
per kind of module. A per-layer finder takes `(trace, layer)`, a per-model one `(trace)`; each
returns the `ModuleCall` it names, or None when the trace has none.
"""
