"""Fixtures for the contracts tests (defined in chainfixtures.py, a uniquely named module)."""

from chainfixtures import deployment, devchain, pools  # noqa: F401
