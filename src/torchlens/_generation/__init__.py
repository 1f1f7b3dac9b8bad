"""`trace_generate` and the decode-path check, part of the tracing layer: the argument checks,
the hooks that capture each forward call of a generation, what a generation's trace is, and each
decode step held against a full forward without the cache. `torchlens` re-exports the public
names."""
