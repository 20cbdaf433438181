"""Which (layout, dp mode, dtype, embedding) combinations this build runs: the one place that refuses the rest.

Called by ``context.resolve_layout``, so a refused combination fails before any process group exists, and by the
planner's search. The list of refusals, with the reason for each, is also stated independently in
tests/parity/matrix.py and shown in the README ("What is proven").
"""
from __future__ import annotations

from engine.config import Config, ConfigError
from engine.parallel.dp.zero import check_zero_supported


def check_supported(cfg: Config, layout) -> None:
    """Refuse, with the combination named, what this build cannot run. ``layout`` has ``tp``, ``pp``, ``dp``."""
    if cfg.parallel.dp_mode == "zero":
        check_zero_supported(cfg, layout)
    elif cfg.parallel.zero_stage:
        raise ConfigError(f"parallel.zero_stage={cfg.parallel.zero_stage} needs parallel.dp_mode=zero, not "
                          f"{cfg.parallel.dp_mode}; fsdp shards like ZeRO-3 (reshard_after_forward=true)")
