"""One file per pipeline schedule beyond 1F1B and GPipe (engine/parallel/pp/schedule.py, with the registry):
each holds its table function and its ScheduleSpec (engine/parallel/pp/actions.py)."""
