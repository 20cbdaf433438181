"""The layout: the rank mesh over named axes (mesh.py, no torch), the checks that resolve a config and a world size
into one (checks.py), the ParallelContext holding its process groups (context.py) and the threads per rank
(threads.py). Every axis package asks it for its group by name."""
