"""`python -m autopar ...` is the `autopar` command (and :func:`run` its console script)."""

import os
import sys


def run() -> int:
    """:func:`autopar.cli.main` as its own process: an interrupt while its modules load (the
    first second) ends as any other interrupt does, one line and status 130; after an
    interrupt, or a failure in a job of several processes (everything unwound, the files'
    temporaries removed), the process leaves at once: JAX's threads may still run, and the
    interpreter's shutdown under them crashed (status 139) or waited for the job's other
    processes forever."""
    try:
        from autopar.cli import main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    status = main()
    if status == 130 or (status and _in_a_job()):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # (a closed pipe: nothing more to say)
                pass
        os._exit(status)
    return status


def _in_a_job() -> bool:
    """Whether this process is one of a jax.distributed job: one that failed leaves at
    once too, as the interpreter's exit waits for every process at the job's shutdown, and
    the others may never get there (they wait for it in a collective)."""
    from autopar.multihost import several

    return several()


if __name__ == "__main__":
    raise SystemExit(run())
