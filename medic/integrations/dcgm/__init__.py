"""DCGM diagnostics on real nodes: run `dcgmi diag` through a runner, read its JSON, judge it."""
