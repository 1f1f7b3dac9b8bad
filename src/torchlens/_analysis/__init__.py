"""The analysis layer: from a finished recording to structure (stacks, layers, roles), the
`save=` selection and the facets of every call. It imports `_core` and `_capture`."""
