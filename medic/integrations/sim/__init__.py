"""Simulated backends over one in-process fleet (the demo and the tests use them)."""
