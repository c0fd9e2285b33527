"""GPU Medic: automated fault remediation for GPU training clusters."""

__version__ = "0.1.0"
