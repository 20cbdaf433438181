"""Context parallelism: the sequence split over the cp axis (layout.py), and attention across it."""
