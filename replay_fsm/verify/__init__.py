"""Verification and rendering tools over the table and the real core: the
explorer, trace conformance, the Promela skeleton and the diagrams."""
