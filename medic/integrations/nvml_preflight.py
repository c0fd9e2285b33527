"""NVML's answers for the prolog's quick checks (medic/preflight.py judges them), read within a time limit.

A GPU in a bad state can keep an NVML call from returning for minutes, and the prolog holds a job's
start: the read runs in a daemon thread and the prolog stops waiting at the limit. The thread may
stay blocked in the driver; it ends with the process, which does not wait for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from medic.gpu_state import GpuSnapshot, NodeSnapshot, Unavailable
from medic.integrations.nvml import snapshot
from medic.preflight import GpuAnswers, NodeAnswers

Reader = Callable[[], NodeSnapshot | Unavailable]


def answers(gpu: GpuSnapshot) -> GpuAnswers:
    errors = dict(error.partition(": ")[::2] for error in gpu.errors)
    if gpu.lost:
        # No handle: NVML's error says why. A read cut short by NVML_ERROR_GPU_IS_LOST lists no
        # error for it, so NVML's own words for that code stand in.
        why = errors.get("handle") or "GPU is lost"
        return GpuAnswers(gpu.index, lost=why)
    remap = gpu.row_remap
    return GpuAnswers(
        gpu.index,
        ecc_volatile_uncorrected=gpu.ecc.volatile_uncorrected,
        retired_pages_pending=gpu.retired_pages.pending if gpu.retired_pages else None,
        row_remap=(remap.pending, remap.failure) if remap else None,
        clock_reasons=gpu.clock_reasons,
        persistence_mode=gpu.persistence_mode,
        unsupported=frozenset(gpu.unsupported),
        errors=errors,
    )


def read(timeout_s: float, reader: Reader = snapshot) -> NodeAnswers | Unavailable | None:
    """One NVML read of this node's GPUs; None when it did not finish within `timeout_s`. An
    exception of the reader's (a bug, not NVML: NVML's errors are in its answer) is raised here."""
    done: list[NodeSnapshot | Unavailable] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            done.append(reader())
        except BaseException as error:  # handed to the waiting thread, which raises it
            failed.append(error)

    worker = threading.Thread(target=work, name="nvml-preflight", daemon=True)
    worker.start()
    worker.join(max(timeout_s, 0.0))
    if failed:
        raise failed[0]
    if not done:
        return None
    found = done[0]
    if isinstance(found, Unavailable):
        return found
    return NodeAnswers(found.gpu_count, tuple(answers(g) for g in found.gpus))
