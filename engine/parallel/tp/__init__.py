"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): the column-/row-/vocab-parallel layers and the plan that
applies them (layers.py), the MoE block and q/k norms under tp (moe.py), the vocab-parallel cross-entropy
(cross_entropy.py). Its collectives are engine/parallel/autograd/comm.py."""
