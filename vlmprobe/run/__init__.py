"""The sweep's side of the process boundary: the command's work from its config to its tables (command.py), the
runner and its rows (sweep.py), the launchers (launchers.py, pool.py, slurm.py), the worker client (workers.py),
torchrun (torchrun.py), a distributed point's ranks (ranks.py), resume (resume.py) and the max-batch search
(max_batch.py)."""
