"""Memory and step-time planning before a run: FLOPs, activations, model state, layout search."""
