"""launcher=pool: up to launcher.jobs points at once, in worker processes (vlmprobe.run.launchers says when).

Pool threads each take the next point from one queue and wait on a worker for it; the main thread records their
rows and forks the long-lived workers: the first ones before any pool thread starts, a replacement when a pool
thread asks for one (its worker died or timed out), between two rows. So no other thread of this process is inside
anything but a wait when one is forked (a fork copies the process as it stands: a half-applied patch or a held lock
would be copied too). A point that needs a fresh process (cuda, measure.isolate=true) gets one of its own; the
others are measured one after another by one long-lived worker per pool thread. On cuda each pool thread holds a
GPU of its own and pins its workers to it (CUDA_VISIBLE_DEVICES): two workers on one GPU would read each other's
allocations into their peaks. A Ctrl-C reaches the main thread only: it kills every worker's process group and
writes no row after it.
"""

from __future__ import annotations

import queue
import threading

from vlmprobe import child, interrupt
from vlmprobe.point.measure import error_row
from vlmprobe.results import report
from vlmprobe.run import workers as worker_processes

__all__ = ["POLL_S", "Pool"]

POLL_S = 0.5  # how often a waiting thread wakes (a Ctrl-C is handled at once anyway)


class Pool:
    """Runs `todo` (planned points without a row) through `runner`, `workers` at a time, updating `bar` as each
    finishes; `gpus`: the GPUs to pin workers to (cuda), or None."""

    def __init__(self, todo: list, runner, workers: int, bar, gpus: list[str] | None):
        self.todo, self.runner, self.bar = todo, runner, bar
        self.count = min(workers, len(todo))  # pool threads
        self.children = child.Children()
        self.free_gpus: queue.Queue | None = None
        if gpus is not None:
            self.free_gpus = queue.Queue()
            for gpu in gpus[:workers]:
                self.free_gpus.put(gpu)
        self.waiting: queue.Queue = queue.Queue()  # points no one has taken yet
        for item in todo:
            self.waiting.put(item)
        # for the main thread, from the pool threads: ("row", point, outputs), or ("fork", env, where to put it)
        self.asks: queue.Queue = queue.Queue()
        self.stop = threading.Event()  # set on Ctrl-C (or a failure here): pool threads take no more points
        self.mine = threading.local()  # each pool thread's GPU (kept: there are no more threads than GPUs) and worker
        self.serving: list = []  # every ServingWorker started, to end at the close
        self.first: list = []  # the workers made before the threads start, one for each to take
        self.taking = threading.Lock()  # one thread at a time takes a point or a first worker
        self.threads: list[threading.Thread] = []

    def run(self) -> None:
        if not self.todo:
            return
        config = self.todo[0].config
        if self.free_gpus is None and not worker_processes.isolated(config):
            self.serving.extend(worker_processes.ServingWorker(worker_processes.worker_env(config), self.children)
                                for _ in range(self.count))
        self.first = list(self.serving)
        self.threads = [threading.Thread(target=self.pool_thread, name=f"vlmprobe-pool-{i}", daemon=True)
                        for i in range(self.count)]
        for thread in self.threads:
            thread.start()
        # The main thread only records rows from here on: the report's plotting library is imported meanwhile,
        # not after the last row. A fork waits for that import to end: a child copies a half-made module otherwise
        importing = threading.Thread(target=report.pyplot, name="vlmprobe-import-pyplot", daemon=True)
        importing.start()
        try:
            self.record_rows(importing)
        except BaseException:
            # Ctrl-C (or a failure here): the workers are in sessions of their own, out of the terminal's reach,
            # and would run on; end them, then wait for the threads (a call returns once its worker is killed; a
            # thread waiting for a worker to be made gives up)
            self.stop.set()
            self.children.kill()
            self.join()
            raise
        self.stop.set()
        self.join()
        importing.join()  # the distributed points run next may fork (ranks.simulate_elsewhere): not mid-import
        for worker in self.serving:
            # every row is in: no worker has anything left to finish, and killing spares the sweep each one's
            # interpreter teardown
            worker.close()

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    # the main thread's side

    def record_rows(self, importing: threading.Thread) -> None:
        """Until every point has its row: record the rows the pool threads give, fork the workers they ask for."""
        left = len(self.todo)
        while left:
            self.bar.set_postfix_str(f"{sum(t.is_alive() for t in self.threads)} running")
            try:
                ask = self.asks.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if ask[0] == "fork":
                _, env, made = ask
                importing.join()
                worker = worker_processes.ServingWorker(env, self.children)
                self.serving.append(worker)
                made.put(worker)
                continue
            if interrupt.received():
                raise KeyboardInterrupt  # a worker killed by the interruption is no result
            _, item, outputs = ask
            self.runner.record(item, outputs)
            self.bar.update(1)
            left -= 1

    # the pool threads' side

    def pool_thread(self) -> None:
        while not self.stop.is_set() and (item := self.take()) is not None:
            try:
                outputs = self.run_one(item)
            except Exception as exc:  # a fault of the pool's own, not of the point: still that point's row
                outputs = error_row(exc)
            self.asks.put(("row", item, outputs))

    def take(self):
        with self.taking:
            return self.waiting.get_nowait() if self.waiting.qsize() else None

    def run_one(self, item) -> dict:
        config = self.runner.with_snapshot_file(item)
        env, timeout = self.env_of(config), config["measure"]["timeout_s"]
        if worker_processes.isolated(config):  # cuda, or measure.isolate=true: a fresh process for this point
            return worker_processes.call_worker(config, env, timeout, self.children)
        return self.serving_worker(env).call(config, timeout)

    def env_of(self, config: dict) -> dict:
        env = worker_processes.worker_env(config)
        if self.free_gpus is None:
            return env
        if not hasattr(self.mine, "gpu"):
            self.mine.gpu = self.free_gpus.get_nowait()
        return {**env, "CUDA_VISIBLE_DEVICES": self.mine.gpu}

    def serving_worker(self, env: dict):
        """This thread's worker, started anew when it has ended or the point needs another environment (its
        allocator settings)."""
        settings = worker_processes.allocator_settings
        current = getattr(self.mine, "worker", None)
        if current is None or settings(current.env) != settings(env) or not current.alive():
            if current is not None:
                current.close()
            with self.taking:
                current = next((w for w in self.first if settings(w.env) == settings(env)), None)
                if current is not None:
                    self.first.remove(current)
            if current is None:
                current = self.forked(env)
            self.mine.worker = current
        return current

    def forked(self, env: dict):
        """A worker the main thread forks for this thread (between two rows)."""
        made: queue.Queue = queue.Queue()
        self.asks.put(("fork", env, made))
        while True:
            try:
                return made.get(timeout=POLL_S)
            except queue.Empty:
                if self.stop.is_set():
                    raise RuntimeError("the pool stopped before a worker was made for this point") from None
