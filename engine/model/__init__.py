"""The transformer and what defines or fills it: families, RoPE, document masks, initialisation, HF weights."""
