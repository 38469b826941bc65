#!/usr/bin/env python3
"""What outofcuda gains: the benchmark ships in the package (outofcuda/bench.py)
so that `outofcuda bench` works from any installed copy; this file runs the
installed one from a checkout.

Example::

    python benchmarks/gain.py --out bench-results          # GPU: full sizes
    python benchmarks/gain.py --smoke --out /tmp/smoke      # anywhere, tiny
"""
import sys

try:
    from outofcuda.bench import main
except ImportError as exc:
    sys.exit(f"gain.py: outofcuda is not installed in this Python ({exc}); "
             "pip install . first, or run `outofcuda bench`")

if __name__ == "__main__":
    sys.exit(main(prog="gain.py"))
