"""The runtime: ``Pipeline`` and what it delegates to (collector links, the
transfer worker, observers, checked mode)."""
