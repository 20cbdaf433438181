"""One file per pipeline schedule beyond 1F1B and GPipe (engine/parallel/pp/schedule.py): each holds its table
function, which its ScheduleSpec (engine/kinds/schedules.py) names and engine/parallel/pp/schedule.py resolves."""
