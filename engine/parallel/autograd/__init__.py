"""Autograd Functions over a process group that know no axis, below both tp/ and pp/: Megatron's f and g
collectives and their sequence-parallel forms (comm.py), and the linear whose weight gradient zero bubble defers
(weight_grad.py). The tp layers call both; the pipeline executor holds the WeightGradStore. Here, not in tp/ or
pp/, so that neither axis imports the other (weight_grad's sequence-parallel linear needs comm's gathers)."""
