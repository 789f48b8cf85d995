"""N fresh processes for one point: a torchrun job (`python -m torch.distributed.run --standalone
--nproc-per-node N -m vlmprobe.point.worker REQUEST`), the same for both device kinds; only the collective
backend differs (cpu: gloo on real CPU tensors, cuda: nccl with one GPU per rank). Each rank is
vlmprobe.point.rank.run_rank, which leaves its row in `rank<r>.json` beside the request.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from vlmprobe import child
from vlmprobe.point.measure import TAIL
from vlmprobe.states import Status

__all__ = ["launch"]


def launch(config: dict, env: dict, timeout: float | None) -> tuple[dict[int, dict], dict | None]:
    """Run the point as one job of dist.world_size ranks; (rank -> row for the ranks that wrote one, the
    job's failure or None)."""
    world = config["dist"]["world_size"]
    with tempfile.TemporaryDirectory(prefix="vlmprobe-ranks-") as tmp:
        request = Path(tmp) / "point.json"
        request.write_text(json.dumps(config))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   "-m", "vlmprobe.point.worker", str(request)]
        code, _, stderr = child.run(command, None, env, timeout)  # its own group: a timeout ends the whole job
        failure = None
        if code is None:
            failure = {"status": Status.TIMEOUT, "error": f"no result after {timeout} s; stderr tail: {stderr[-TAIL:]}"}
        elif code != 0:
            failure = {"status": Status.CRASH, "error": f"torchrun exit code {code}; stderr tail: {stderr.strip()[-TAIL:]}"}
        rows = {r: json.loads(f.read_text()) for r in range(world) if (f := Path(tmp) / f"rank{r}.json").is_file()}
    return rows, failure
