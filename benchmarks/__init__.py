"""Benchmarks of cas_bank: scripts run as `python -m benchmarks.<name>`, each printing
its figures beside the ceilings measured in the same run (never timed unit tests)."""
