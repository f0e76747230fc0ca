"""Helpers shared by every test package, in one place.

- ``sessions``: two ``MoqtSession``s wired back to back in memory (no network).
- ``processes``: free loopback ports, a development CA with a server certificate, and a launcher for real
  ``python -m relay`` processes that returns once the relay serves.
- ``waiting``: polls with deadlines, for waiting on a condition instead of sleeping a fixed time.
"""
