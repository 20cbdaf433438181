"""Data parallelism: one strategy per dp mode (ddp, fsdp, zero) behind one interface."""
