"""Token data: tokenizer and datasets, blends, and the per-rank batch feed."""
