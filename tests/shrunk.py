"""The shrunk tiny model that most multi-process tests train: configs/tiny.yaml's model cut to 2 layers of hidden 64
(intermediate 128, 4 heads, 2 kv heads) on 32-token sequences. A process start costs seconds of imports on a
2-core machine, so the steps must be cheap. Tests add their config (``--config configs/tiny.yaml``), steps,
batches and layout; a later ``--key value`` wins (engine.config.load), so ``[*SHRUNK, "--model.num_layers", "4"]``
is the same model with 4 layers."""

SHRUNK = [
    "--model.num_layers",
    "2",
    "--model.hidden_size",
    "64",
    "--model.intermediate_size",
    "128",
    "--model.num_heads",
    "4",
    "--model.num_kv_heads",
    "2",
    "--train.seq_len",
    "32",
]
# A 5-step run of it (warm-up 1, no progress bar): the bad-step tests' and the launcher refusals' run.
FIVE_STEPS = [
    "--config",
    "configs/tiny.yaml",
    *SHRUNK,
    "--train.steps",
    "5",
    "--train.warmup_steps",
    "1",
    "--log.progress",
    "false",
]
