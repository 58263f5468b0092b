"""Tensor parallelism: the TP group and its collectives (group.py), the worker ranks' loop
(worker.py), and rank 0's driver with the `mp` and `ray` launchers (executor.py).
docs/scaling.md explains the design."""
