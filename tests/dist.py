"""The one way multi-rank tests start ranks: forked gloo processes (engine/cluster/spawn.py)."""
from engine.cluster.spawn import free_port, run_ranks

__all__ = ["free_port", "run_ranks", "warm_imports"]


def warm_imports() -> None:
    """Import, once in the parent, what every forked rank would otherwise import for itself: transformers (the
    tokenizer loader) and the torch modules that the first meta-device initialisation pulls in (torch._refs,
    torch._dynamo). Measured: 6-9 s and 3.6 s per rank, paid by 8 ranks on 2 cores at every spawn. Only imports:
    nothing here starts a thread, so forking stays safe (tests/conftest.py)."""
    from engine.model import transformer as model_lib
    from engine.config import ModelConfig
    from engine.data.dataset import load_tokenizer

    load_tokenizer("")  # imports transformers' tokenizer classes
    model_lib.build(ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                                num_kv_heads=2), device="meta")
