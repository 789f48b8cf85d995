"""N fresh processes for one point: a torchrun job (`python -m torch.distributed.run --standalone
--nproc-per-node N -m vlmprobe.worker REQUEST`), the same for both device kinds; only the collective
backend differs (cpu: gloo on real CPU tensors, cuda: nccl with one GPU per rank).

Each rank joins the job's process group, measures as the single-GPU worker does, and writes its row to
`rank<r>.json` beside the request. A rank that runs out of memory, or whose measurement raises, writes its `oom`
or `error` row and exits at once with FAILED_EXIT: torchrun then stops the other ranks (which would otherwise wait
in a collective), and the point is `oom` or `error` naming that rank and its exception (not the end of torchrun's
stderr, where the exception's own line may be out of reach).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from vlmprobe import child

FAILED_EXIT = 75  # a rank's exit code after it wrote an `oom` or `error` row


def launch(config: dict, env: dict, timeout: float | None) -> tuple[dict[int, dict], dict | None]:
    """Run the point as one job of dist.world_size ranks; (rank -> row for the ranks that wrote one, the
    job's failure or None)."""
    from vlmprobe.worker import TAIL

    world = config["dist"]["world_size"]
    with tempfile.TemporaryDirectory(prefix="vlmprobe-ranks-") as tmp:
        request = Path(tmp) / "point.json"
        request.write_text(json.dumps(config))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   "-m", "vlmprobe.worker", str(request)]
        code, _, stderr = child.run(command, None, env, timeout)  # its own group: a timeout ends the whole job
        failure = None
        if code is None:
            failure = {"status": "timeout", "error": f"no result after {timeout} s; stderr tail: {stderr[-TAIL:]}"}
        elif code != 0:
            failure = {"status": "crash", "error": f"torchrun exit code {code}; stderr tail: {stderr.strip()[-TAIL:]}"}
        rows = {r: json.loads(f.read_text()) for r in range(world) if (f := Path(tmp) / f"rank{r}.json").is_file()}
    return rows, failure


def run_rank(request: Path, measure) -> int:
    """One rank of a launched job (in the process torchrun started): join the group, measure, write the row.
    Returns the exit code."""
    from vlmprobe import backends
    from vlmprobe.distributed.process_group import real_group
    from vlmprobe.worker import error_row

    point = json.loads(request.read_text())
    backend = backends.get(point["measure"]["backend"])
    backend.select_device(int(os.environ["LOCAL_RANK"]))  # before the group: nccl binds to the current device
    with real_group(backend.device_type) as rank:
        if point["measure"].get("snapshot_file"):  # one file per rank
            point["measure"]["snapshot_file"] = point["measure"]["snapshot_file"].replace(".pickle", f".rank{rank}.pickle")
        try:
            row = measure(point)
        except Exception as exc:
            row = error_row(exc)
        (request.parent / f"rank{rank}.json").write_text(json.dumps(row))
        if row["status"] != "ok":  # the others wait for this rank in a collective: leave now, torchrun stops them
            sys.stdout.flush()
            os._exit(FAILED_EXIT)
    return 0
