"""Pipeline parallelism: schedules as data (actions.py's vocabulary, the registry and 1F1B/GPipe in schedule.py, one
file per other schedule in schedules/), simulated under NCCL's rules (simulator.py), run by the executor
(executor.py); which layers each stage holds (split.py, no torch), a rank's virtual chunks (virtual.py) and the tied
embedding split over the first and last stage (tied.py). Zero bubble's split backward is
engine/parallel/autograd/weight_grad.py."""
