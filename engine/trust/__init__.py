"""Run-time trust checks (issue 44): what the engine verifies about a running job beyond its own crashes. Each check is
entered from the trainer through one small call; ``replicas.py``: the ranks that must hold identical weights
compare a digest of each tensor (silent data corruption); ``goodput.py``: where the run's wall time went, across
restarts (out_dir/goodput.json); ``stragglers.py``: every log.every steps, the rank or host whose compute is slower
than its peers' median, and what it costs the step; ``oplog.py`` + ``hang.py`` + ``hangreport.py``: a hang named by
its operation and the rank(s) that never entered it (parallel.hang_timeout_s); ``saved.py``, entered from the
checkpointer: a resume checked against digests of what was saved."""
