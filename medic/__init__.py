"""GPU Medic: automated fault remediation for GPU training clusters."""

# The release (pyproject.toml reads it; CHANGELOG.md has its entry; medic/store/migrate.py names the
# store schema it writes).
__version__ = "0.3.0"
