"""`vlmprobe serve [--host H] [--port N] [--results-dir DIR]` (also `python -m vlmprobe serve`): the web page on
uvicorn, bound to 127.0.0.1:8000 unless told otherwise.

The rule: the arguments are checked first (a bad one is one line, exit 2, before the web packages or torch are
imported); a host other than the local machine's is warned about, since whoever reaches it can run estimates on
this machine. Without the web extra installed the command says how to install it (exit 2). Estimates write their
results dirs under --results-dir, or a temporary folder made for the server (kept after it stops; its path is
printed). Known limits: no authentication, no TLS: put it behind a proxy that has them before exposing it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from vlmprobe.errors import ConfigError

__all__ = ["LOCAL_HOSTS", "parse", "serve"]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
USAGE = "vlmprobe serve [--host HOST] [--port N] [--results-dir DIR]"
WEB_PACKAGES = ("fastapi", "uvicorn", "starlette", "jinja2")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parse(argv: list[str]) -> dict:
    """{"host", "port", "results_dir"} from the arguments; ConfigError (one line) for a bad one."""
    options = {"host": "127.0.0.1", "port": 8000, "results_dir": None}
    names = {"--host": "host", "--port": "port", "--results-dir": "results_dir"}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, sep, value = arg.partition("=")
        if name not in names:
            raise ConfigError(f"{arg[:60]} is not allowed: {USAGE}")
        if not sep:
            if i + 1 == len(argv):
                raise ConfigError(f"{name} is not allowed without a value: {USAGE}")
            value, i = argv[i + 1], i + 1
        options[names[name]] = value
        i += 1
    port = str(options["port"])
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--port={port[:20]!r} is not allowed: give a port number from 0 to 65535")
    options["port"] = int(port)
    if not options["host"] or any(c.isspace() for c in options["host"]):
        raise ConfigError(f"--host={options['host']!r} is not allowed: give a host name or address, e.g. 127.0.0.1")
    if options["results_dir"] is not None:
        folder = Path(options["results_dir"]).expanduser()
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--results-dir={options['results_dir']} is not allowed: it is a file; give a folder")
        options["results_dir"] = folder
    return options


def serve(argv: list[str]) -> int:
    """The command; returns its exit code."""
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: {USAGE}\n\n{__doc__.strip()}")
        return 0
    try:
        options = parse(argv)
    except ConfigError as exc:
        say(f"vlmprobe: serve: {exc}")
        return 2
    try:
        # imported here: the arguments are checked before the web packages and torch load (seconds), and a
        # missing web extra is one line rather than a traceback
        import uvicorn

        from vlmprobe.web.app import make_app  # here: see above (it imports fastapi and vlmprobe.api, torch)
    except ImportError as exc:
        if exc.name not in WEB_PACKAGES:
            raise
        say(f"vlmprobe: serve needs the web extra ({exc.name} is not installed): pip install -e \".[web]\"")
        return 2
    results_dir = options["results_dir"] or Path(tempfile.mkdtemp(prefix="vlmprobe-serve-"))
    results_dir.mkdir(parents=True, exist_ok=True)
    host, port = options["host"], options["port"]
    if host not in LOCAL_HOSTS:
        say(f"vlmprobe: serve: warning: listening on {host}, not only this machine: anyone who can reach "
            f"{host}:{port} can run estimates here (no authentication); use --host 127.0.0.1 to keep it local")
    say(f"vlmprobe: serve: http://{'[' + host + ']' if ':' in host else host}:{port}/ (results in {results_dir}); "
        f"Ctrl-C stops it")
    uvicorn.run(make_app(results_dir), host=host, port=port, log_level="warning")
    return 0
