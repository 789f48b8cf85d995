"""`python -m vlmprobe` and the `vlmprobe` console script: the command (vlmprobe.cli.main), ended without the
interpreter's teardown.

The process ends through an exit handler that flushes the streams and calls os._exit once every other exit handler
has run (logging's flush, weakref finalizers, multiprocessing's): handlers run last-registered first, so this one
is registered before anything else is imported. The teardown would otherwise deallocate torch's, transformers' and
sympy's objects module by module: about a second of every command, after its last line was written.
"""

import atexit
import os
import sys



def console() -> None:
    """The `vlmprobe` console script and `python -m vlmprobe`."""
    exit_code = [1]

    def flush_and_exit():
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (BrokenPipeError, ValueError):  # a reader that left early, a closed stream
                pass
        os._exit(exit_code[0])

    atexit.register(flush_and_exit)
    if sys.argv[1:2] == ["serve"]:  # the web page (vlmprobe.web): its own arguments, --host, --port
        from vlmprobe.web.serve import serve  # after the handler: see above

        exit_code[0] = serve(sys.argv[2:])
        sys.exit(exit_code[0])
    from vlmprobe.cli import main  # after the handler: see above

    exit_code[0] = main()
    sys.exit(exit_code[0])


if __name__ == "__main__":
    console()
