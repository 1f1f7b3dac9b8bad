"""The naming layer: other libraries' hook names (one table per naming generation), the targets
their rows point at, the one resolver, and the diagnosis of a mismatching tensor."""
