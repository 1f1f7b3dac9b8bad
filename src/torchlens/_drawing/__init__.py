"""The parts of `Trace.draw` (`torchlens._draw`): style, rolled stacks, the scene, layout and SVG."""
