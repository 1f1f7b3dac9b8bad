"""The capture layer: the recorder (a torch function mode and module hooks), compiled and
accelerate-dispatched code under a trace, the snapshot and the stores. It imports `_core` only."""
