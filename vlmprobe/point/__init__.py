"""A point's side of the process boundary: building its parts (build.py), measuring it (measure.py), one rank of a
distributed point (rank.py), and the worker process's protocol (worker.py)."""
