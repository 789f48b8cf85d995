"""The server's estimates: one worker thread runs them one after another through vlmprobe.api, and each client
has at most one queued or running at a time.

The rule: a question is a Job; `Jobs.submit` queues it (refusing a client's second while its first is not done),
the worker runs `api.run` / `api.advise` with the server's results_dir and launcher=local (a thread of a server
forks no pool of workers), and the page polls `Jobs.get`. While a job runs, what the command writes to stdout (the
answer as the terminal gives it) and stderr (its progress) from the worker thread is kept in the job; other
threads' writes go on to the real streams (sys.stdout / sys.stderr are swapped for a router while it runs).
Known limits: a job cannot be cancelled once it runs; jobs live in memory (a restart forgets them, the results
dirs stay on disk); one estimate at a time for the whole server, since the estimate's caches are per process.
"""

from __future__ import annotations

import itertools
import queue
import secrets
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from vlmprobe import api
from vlmprobe.errors import ConfigError, first_line
from vlmprobe.web.fields import Question

__all__ = ["Busy", "Job", "Jobs"]

DONE, FAILED, QUEUED, RUNNING = "done", "failed", "queued", "running"


class Busy(Exception):
    """A client asked again while its estimate is still queued or running."""


@dataclass
class Job:
    id: str
    client: str
    question: Question
    number: int
    state: str = QUEUED
    progress: list[str] = field(default_factory=list)  # stderr lines
    answer: str = ""  # stdout: the answer as the terminal gives it
    error: str = ""  # the one line of a refusal or failure
    result: api.Result | None = None
    started: float | None = None
    finished: float | None = None

    @property
    def over(self) -> bool:
        return self.state in (DONE, FAILED)


class Router:
    """A stream that sends the writes of one thread to `sink` and every other thread's to `fallback`."""

    def __init__(self, fallback, thread: int, sink):
        self.fallback, self.thread, self.sink = fallback, thread, sink

    def write(self, text: str) -> int:
        if threading.get_ident() == self.thread:
            self.sink(text)
            return len(text)
        return self.fallback.write(text) if self.fallback is not None else len(text)

    def flush(self) -> None:
        if threading.get_ident() != self.thread and self.fallback is not None:
            self.fallback.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):  # encoding, fileno, ...: the real stream's
        return getattr(self.fallback, name)


class Jobs:
    """The queue of estimates and the worker thread that runs them (started with the first job)."""

    def __init__(self, results_dir: Path, run=None):
        self.results_dir = Path(results_dir)
        self.run = run  # for tests: a stand-in for vlmprobe.api.run (same arguments, returns a Result)
        self.jobs: dict[str, Job] = {}
        self.waiting: queue.Queue[Job] = queue.Queue()
        self.lock = threading.Lock()
        self.numbers = itertools.count(1)
        self.worker: threading.Thread | None = None

    def submit(self, client: str, question: Question) -> Job:
        with self.lock:
            mine = [j for j in self.jobs.values() if j.client == client and not j.over]
            if mine:
                raise Busy(f"one estimate at a time: yours (number {mine[0].number}) is still {mine[0].state}; "
                           f"this one was not queued")
            job = Job(secrets.token_hex(8), client, question, next(self.numbers))
            self.jobs[job.id] = job
            self.waiting.put(job)
            if self.worker is None:
                self.worker = threading.Thread(target=self.work, name="vlmprobe-estimates", daemon=True)
                self.worker.start()
        return job

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def ahead(self, job: Job) -> int:
        """Jobs that will run before this one (queued earlier, or running)."""
        return sum(1 for j in list(self.jobs.values()) if not j.over and j.number < job.number)

    def work(self) -> None:
        while True:
            self.run_one(self.waiting.get())

    def run_one(self, job: Job) -> None:
        job.state, job.started = RUNNING, time.time()
        pending = {"out": "", "err": ""}

        def sink(kind: str):
            def write(text: str) -> None:
                if kind == "out":
                    job.answer += text
                    return
                pending["err"] += text.replace("\r", "\n")
                *lines, pending["err"] = pending["err"].split("\n")
                job.progress += [line for line in lines if line.strip()]
            return write

        me = threading.get_ident()
        real_out, real_err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = Router(real_out, me, sink("out")), Router(real_err, me, sink("err"))
        try:
            run = self.run or api.run
            overrides = [o for o in job.question.overrides]
            job.result = run(*overrides, results_dir=str(self.results_dir), launcher="local")
            job.state = DONE
        except ConfigError as exc:
            job.error, job.state = f"vlmprobe: {exc}", FAILED
        except KeyboardInterrupt:
            job.error, job.state = "vlmprobe: interrupted", FAILED
        except Exception as exc:  # vlmprobe's own failure: one line on the page, the traceback in the server's log
            job.error, job.state = (f"vlmprobe: internal error, not a problem with your input ({type(exc).__name__}: "
                                    f"{first_line(exc)}); the traceback is in the server's log"), FAILED
            traceback.print_exc(file=real_err)
        finally:
            sys.stdout, sys.stderr = real_out, real_err
            if pending["err"].strip():
                job.progress.append(pending["err"])
            job.finished = time.time()
