"""Hosts and processes: hostfiles, host checks, the link test, local rank spawning, error reporting."""
