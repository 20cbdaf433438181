"""What a run reports: metrics.jsonl, per-step stats and phase timers, memory counting, TensorBoard."""
