"""`python -m autopar ...` is the `autopar` command (and :func:`run` its console script)."""

import os
import sys


def run() -> int:
    """:func:`autopar.cli.main` as its own process: an interrupt while its modules load (the
    first second) ends as any other interrupt does, one line and status 130; after an
    interrupt (everything unwound, the files' temporaries removed) the process leaves at
    once: JAX's threads may still run, and the interpreter's shutdown under them crashed
    (status 139)."""
    try:
        from autopar.cli import main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    status = main()
    if status == 130:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # (a closed pipe: nothing more to say)
                pass
        os._exit(130)
    return status


if __name__ == "__main__":
    raise SystemExit(run())
