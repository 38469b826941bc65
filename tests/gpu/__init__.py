"""GPU-only checks (skip without a GPU); a package so their basenames may repeat tests/."""
