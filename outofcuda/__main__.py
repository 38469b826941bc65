"""``python -m outofcuda`` and the ``outofcuda`` console script.

Example::

    $ outofcuda            # same as `outofcuda status`
    $ outofcuda doctor --json
"""
import sys


def main(argv=None):
    """Runs the command line; returns the exit code."""
    try:
        from .cli import main as cli_main
    except ImportError as exc:
        # The C extension is missing or damaged: say so plainly instead of a
        # traceback, since this is exactly when someone runs `outofcuda doctor`.
        print(exc if str(exc).startswith("outofcuda") else f"outofcuda: {exc}", file=sys.stderr)
        return 1
    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
