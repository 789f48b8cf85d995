"""The worker process: `python -m vlmprobe.point.worker` measures points for the sweep in a process of their own.

The protocol, one mode per command line:
- no argument: one request (JSON) on stdin, a point or {"describe": BACKEND}; its result is printed as the last
  stdout line, `ROW_PREFIX{json}`, and the process ends (a cuda point gets a fresh CUDA context this way);
- `--serve`: one point per stdin line, each result printed as soon as it is known (launcher=pool's long-lived
  workers where they cannot be forked);
- `--simulate-rank R`: one rank of a distributed point on a fake process group, the point on stdin;
- `PATH`: one rank of a torchrun job, the point in the file PATH.
An out-of-memory is a result (status `oom`); a measurement that raises ends the process with RAISED and its
traceback on stderr, for the sweep to record as an `error` row.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from vlmprobe import backends
from vlmprobe.point.measure import error_row, measure
from vlmprobe.point.rank import run_rank, simulate_rank

__all__ = ["RAISED", "ROW_PREFIX", "last_row", "print_row", "run_command", "serve"]

ROW_PREFIX = "VLMPROBE_ROW "
RAISED = 3  # exit code when the measurement raised: the sweep records status `error` with the traceback


def print_row(result: dict) -> None:
    """`result` as the protocol's row line, on a line of its own whatever a library printed before it."""
    sys.stdout.write("\n" + ROW_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def last_row(stdout: str) -> dict | None:
    """The result a worker printed (its last row line), or None where it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith(ROW_PREFIX)]
    return json.loads(lines[-1][len(ROW_PREFIX):]) if lines else None


def serve() -> None:
    """A serving worker (vlmprobe.run.workers.ServingWorker): one point per stdin line, measured one after another
    in this process, each result printed as soon as it is known. A point that raises is an `error` row, as when
    the sweep process measures it (vlmprobe.run.sweep.run_point), and the next line is read."""
    for line in sys.stdin:
        try:
            result = measure(json.loads(line))
        except Exception as exc:
            result = error_row(exc)
        print_row(result)


def main(argv: list[str]) -> int:
    """The worker process's exit code for its command line (module docstring)."""
    if argv == ["--serve"]:
        serve()
    elif argv[:1] == ["--simulate-rank"]:
        print_row(simulate_rank(json.loads(sys.stdin.read()), int(argv[1])))
    elif argv:
        return run_rank(Path(argv[0]))
    else:
        request = json.loads(sys.stdin.read())
        print_row(backends.get(request["describe"]).describe() if "describe" in request else measure(request))
    return 0


def run_command(argv: list[str]) -> int:
    """What `python -m vlmprobe.point.worker ARGV` exits with: main's code, or RAISED with the traceback on stderr
    where it raised. Also what a worker forked from the sweep runs (vlmprobe.run.workers.call_worker)."""
    try:
        return main(argv)
    except Exception:
        traceback.print_exc()
        return RAISED


if __name__ == "__main__":
    sys.exit(run_command(sys.argv[1:]))
