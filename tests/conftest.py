"""Session set-up shared by every test."""
import torch

# The pytest process forks gloo ranks (tests/dist.py). GNU OpenMP, which CPU torch uses for intra-op parallelism,
# is not fork-safe: once the parent has run a multi-threaded op, a child that runs one hangs. So the parent stays
# single-threaded, and each forked rank picks its own thread count.
torch.set_num_threads(1)

# Forked ranks inherit the parent's imports: pay for transformers and torch's lazy modules once, not per rank.
from tests.dist import warm_imports  # noqa: E402

warm_imports()
