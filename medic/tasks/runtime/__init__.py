"""What every task runs on: the process's store, backends and policy (`process`), a stage's record
(`stage`), the retry rule, the processes that hold claims, the fleet snapshot decisions read, and
GPU Medic's events in Prefect's feed."""
