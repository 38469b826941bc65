"""``python -m outofcuda`` and the ``outofcuda`` console script.

Example::

    $ outofcuda            # same as `outofcuda status`
    $ outofcuda doctor --json
"""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
