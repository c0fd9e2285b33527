"""The reference training job and the training-side hook library (`medic.training.medic_hooks`).

They run inside someone else's training processes: the hook library and the checkpoint layout import
the standard library only, and nothing here imports the rest of GPU Medic
(tests/training/test_training_imports.py).
"""

# The repository's medic/training/ links here: with the root on sys.path this file would load a second time as
# `deployments.training`, a second copy of every module and its state (docs/decisions/0012).
if __name__ != "medic.training":
    raise ImportError(f"{__name__} is medic.training: import it by that name (docs/decisions/0012)")
