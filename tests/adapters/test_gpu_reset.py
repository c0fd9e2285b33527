"""The GPU reset in place through nvidia-smi (medic/integrations/gpu_reset.py): its parsers on what nvidia-smi
printed on a real H200 and on NVSentinel's recorded resets (tests/fixtures/nvidia_smi/SOURCES.md), and
the whole reset over the local runner, with an `nvidia-smi` on PATH that answers each command with
those recordings and logs what it was asked: NVIDIA's preconditions are checked before the reset, the
outcome is read from what it printed, and anything short of a confirmed reset is "not done"."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_reset_support import (
    BUSY,
    H100_BUSES,
    H200,
    IDLE,
    IN_USE,
    NODE,
    NVSENTINEL_BUS,
    SUCCEEDED,
    Node,
    eight_gpus,
    hopper,
    hopper_node,
    line,
    succeeded,
)

from medic.integrations.dcgm.runner import LocalRunner
from medic.integrations.gpu_reset import (
    GPUS,
    PROCESSES,
    Gpu,
    NvidiaSmiGpuReset,
    Process,
    UnreadableOutputError,
    parse_gpus,
    parse_processes,
    parse_reset,
    scope,
)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


# -- the parsers, on recorded output -------------------------------------------------------------


def test_the_recorded_h200_line_is_read_and_the_tests_lines_share_its_format() -> None:
    [gpu] = parse_gpus(H200)
    assert gpu == Gpu(0, "00000000:00:06.0", (9, 0), True)
    assert line(gpu) == H200


def test_recorded_compute_processes_are_read() -> None:
    assert parse_processes(BUSY) == [Process(561, "python3", "00000000:00:06.0")]
    assert parse_processes(IDLE) == []


def test_recorded_reset_answers_are_read() -> None:
    assert parse_reset(SUCCEEDED).reset == {NVSENTINEL_BUS}
    refused = parse_reset(IN_USE)
    assert (refused.reset, refused.refused) == (frozenset(), {NVSENTINEL_BUS: "In use by another client"})


@pytest.mark.parametrize(
    "text",
    [
        "index, pci.bus_id, compute_cap, persistence_mode\n",  # --format=csv, with its header
        "0, 00000000:00:06.0, 9.0\n",  # a field short
        "",
    ],
)
def test_a_gpu_list_we_cannot_read_is_refused(text: str) -> None:
    with pytest.raises(UnreadableOutputError):
        parse_gpus(text)


def test_scope_is_the_gpu_from_hopper_on_and_the_whole_node_before_it_or_when_unknown() -> None:
    hoppers = parse_gpus(eight_gpus((9, 0)))
    assert scope(hoppers, 3) == ([hoppers[3]], None)
    amperes = parse_gpus(eight_gpus((8, 0)))
    chosen, why = scope(amperes, 3)
    assert (len(chosen), why) == (8, "compute capability 8.0: before Hopper, NVLink peers are reset together")
    unknown = parse_gpus(eight_gpus(None))
    assert len(scope(unknown, 3)[0]) == 8
    with pytest.raises(LookupError, match="no GPU 9"):
        scope(hoppers, 9)


# -- the reset, over the local runner --------------------------------------------------------------


def test_a_hopper_gpu_is_reset_alone_with_persistence_mode_off_for_the_reset(node: Node) -> None:
    node.answer(hopper_node((SUCCEEDED, 0)))
    outcome = node.resetter().reset(NODE, 0)
    assert outcome.done, outcome.detail
    assert outcome.detail.startswith(f"reset GPU 0 ({NVSENTINEL_BUS}) on {NODE} with nvidia-smi in ")
    assert outcome.detail.endswith("; persistence mode turned off for it and back on")
    assert node.calls() == [
        " ".join(GPUS),
        " ".join(PROCESSES),
        "-pm 0 -i 0",
        "--gpu-reset -i 0",
        " ".join(GPUS),  # the GPU answers again
        "-pm 1 -i 0",
    ]


def test_a_process_still_on_the_gpu_stops_the_reset_before_anything_changes(node: Node) -> None:
    node.answer({GPUS: [(H200, 0)], PROCESSES: [(BUSY, 0)]})
    outcome = node.resetter().reset(NODE, 0)
    assert (outcome.done, outcome.detail) == (False, f"not reset: pid 561 (python3) holds GPU 0 on {NODE}")
    assert node.calls() == [" ".join(GPUS), " ".join(PROCESSES)]


def test_a_refused_reset_is_not_done_and_persistence_mode_is_restored(node: Node) -> None:
    node.answer(hopper_node((IN_USE, 255)))
    outcome = node.resetter().reset(NODE, 0)
    assert not outcome.done
    assert f"{NVSENTINEL_BUS}: In use by another client" in outcome.detail
    assert "exited 255" in outcome.detail
    assert node.calls()[-1] == "-pm 1 -i 0"


def test_before_hopper_every_gpu_of_the_node_is_reset_and_each_must_say_so(node: Node) -> None:
    answers = {GPUS: [(eight_gpus((8, 0)), 0)], PROCESSES: [(IDLE, 0)]}
    every = ",".join(str(i) for i in range(8))
    answers |= {("-pm", "0", "-i", every): [("", 0)], ("-pm", "1", "-i", every): [("", 0)]}
    node.answer(answers | {("--gpu-reset",): [(succeeded(H100_BUSES), 0)]})
    outcome = node.resetter().reset(NODE, 3)
    assert outcome.done, outcome.detail
    assert outcome.gpus == tuple(range(8))
    assert "(compute capability 8.0: before Hopper, NVLink peers are reset together)" in outcome.detail
    assert "--gpu-reset" in node.calls()  # no -i: all of them, as NVIDIA documents

    # Exit 0, but one GPU without its success line: not confirmed, so not done.
    node.answer(answers | {("--gpu-reset",): [(succeeded(H100_BUSES[:7]), 0)]})
    outcome = node.resetter().reset(NODE, 3)
    assert not outcome.done
    assert outcome.detail.endswith(
        "no success line for GPU 7 (00000000:DB:00.0); persistence mode turned off for it and back on"
    )


def test_a_gpu_that_does_not_answer_after_the_reset_is_not_done(node: Node) -> None:
    node.answer(
        {
            GPUS: [(hopper(persistence=False), 0), ("", 0)],  # listed before, nothing after
            PROCESSES: [(IDLE, 0)],
            ("--gpu-reset", "-i", "0"): [(SUCCEEDED, 0)],
        }
    )
    outcome = node.resetter().reset(NODE, 0)
    assert (outcome.done, outcome.detail) == (
        False,
        f"GPU 0 ({NVSENTINEL_BUS}) reset, but not seen answering again: no GPU listed",
    )
    assert not [c for c in node.calls() if c.startswith("-pm")]  # it was off: left as it was


def test_a_reset_that_hangs_is_given_up_on(node: Node, tmp_path: Path) -> None:
    node.answer({GPUS: [(hopper(persistence=False), 0)], PROCESSES: [(IDLE, 0)]})
    hang = tmp_path / "hang" / "nvidia-smi"
    hang.parent.mkdir()
    # The recorded answers, except that the reset never returns.
    hang.write_text(
        f'#!/bin/sh\ncase "$1" in --gpu-reset) exec sleep 30;; esac\nexec {tmp_path / "nvidia-smi"} "$@"\n'
    )
    hang.chmod(0o755)
    resetter = NvidiaSmiGpuReset(LocalRunner(term_grace_s=0.5), nvidia_smi=str(hang), reset_timeout_s=0.5)
    outcome = resetter.reset(NODE, 0)
    assert not outcome.done
    assert "did not finish within 0.5 s" in outcome.detail


def test_what_cannot_be_read_is_never_reset(node: Node) -> None:
    node.answer({GPUS: [(H200, 0)], PROCESSES: [("561, python3\n", 0)]})
    outcome = node.resetter().reset(NODE, 0)
    assert (outcome.done, outcome.detail) == (False, "not reset: not a process line: '561, python3'")
    assert node.resetter().reset(NODE, 4).detail == "not reset: no GPU 4 (the node lists 0)"
    assert not node.resetter().reset("-oProxyCommand=x", 0).done
    assert not [c for c in node.calls() if "--gpu-reset" in c or c.startswith("-pm")]
