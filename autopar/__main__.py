"""`python -m autopar ...` is the `autopar` command (and :func:`run` its console script)."""

import sys


def run() -> int:
    """:func:`autopar.cli.main`, with an interrupt while its modules load (the first second
    of the command) ending as any other interrupt does: one line, status 130."""
    try:
        from autopar.cli import main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    raise SystemExit(run())
