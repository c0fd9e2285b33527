"""The reference training job and the training-side hook library (`medic.training.medic_hooks`).

They run inside someone else's training processes: the hook library and the checkpoint layout import
the standard library only, and nothing here imports the rest of GPU Medic
(tests/training/test_training_imports.py).
"""
