"""Reference training job: a small deterministic MLP under DDP that checkpoints with DCP and resumes.

    python -m torch.distributed.run --nproc-per-node 2 medic/training/train.py --ckpt-dir /tmp/ckpt

The batch for step s is a pure function of (seed, s) and the algorithms are deterministic, so a
run resumed from step k's checkpoint repeats the uninterrupted run's losses bit for bit (same
world size) and within float rounding at another world size (DCP reshards on load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

# Wall clock, taken before torch's import (the longest part of a restart), so that a benchmark can set
# a restart's phases against the time of the fault; the imports below must come after it.
# ruff: noqa: E402
STARTED = time.time()
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS is deterministic only with this

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from medic.training.checkpoint_layout import latest_complete, step_dir_name
from medic.training.medic_hooks import MedicHooks
from medic.training.profiling import StepProfiler

FEATURES = 16
HIDDEN = 64
FAULT_EXIT_CODE = 13
DEVICES = ("auto", "cpu", "cuda")
INJECTED_CAUSES = ("compute", "copy", "input", "python")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=int(env("TRAIN_STEPS", "100")), help="env TRAIN_STEPS")
    parser.add_argument(
        "--ckpt-every", type=int, default=int(env("TRAIN_CKPT_EVERY", "10")), help="env TRAIN_CKPT_EVERY"
    )
    parser.add_argument(
        "--ckpt-dir", type=Path, default=Path(env("CKPT_DIR", "checkpoints")), help="env CKPT_DIR"
    )
    parser.add_argument(
        "--loss-log",
        type=Path,
        default=Path(env("TRAIN_LOSS_LOG", "losses.jsonl")),
        help="env TRAIN_LOSS_LOG",
    )
    parser.add_argument(
        "--events",
        default=env("MEDIC_EVENTS", "medic-events.jsonl"),
        help="fault events: a JSONL file or an http(s) URL (env MEDIC_EVENTS)",
    )
    parser.add_argument(
        "--job",
        default=env("MEDIC_JOB", os.environ.get("SLURM_JOB_ID", "reference-train")),
        help="env MEDIC_JOB; under Slurm, the job's id",
    )
    parser.add_argument("--seed", type=int, default=int(env("TRAIN_SEED", "1234")), help="env TRAIN_SEED")
    parser.add_argument("--batch-size", type=int, default=64, help="global, split evenly across ranks")
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default=env("TRAIN_DEVICE", "auto"),
        help="auto: CUDA/NCCL when every rank on the node has a GPU of its own, else CPU/gloo (env TRAIN_DEVICE)",
    )
    faults = parser.add_argument_group("fault injection (each fault hits --fail-rank)")
    faults.add_argument("--fail-at-step", type=int, help="exit abruptly at the start of this step")
    faults.add_argument(
        "--fail-during-save",
        action="store_true",
        help="exit instead inside that step's checkpoint save: after writing this rank's shard, "
        "before the metadata (leaves an interrupted checkpoint)",
    )
    faults.add_argument("--nan-at-step", type=int, help="NaN loss at this step (the update is skipped)")
    faults.add_argument("--fail-rank", type=int, default=0)
    peers = parser.add_argument_group("peer comparison and hangs (docs/culprit.md)")
    peers.add_argument(
        "--timings-every",
        type=int,
        default=int(env("MEDIC_TIMINGS_EVERY", "0")) or None,
        help="report step timings every N steps for peer comparison (env MEDIC_TIMINGS_EVERY)",
    )
    peers.add_argument(
        "--node-of-rank",
        default=env("MEDIC_NODE_OF_RANK"),
        help="comma-separated node name per rank, to stand for several nodes on one host "
        "(env MEDIC_NODE_OF_RANK; default: the host name)",
    )
    peers.add_argument("--collective-timeout-s", type=float, help="the process group's collective timeout")
    peers.add_argument(
        "--step-work-s", type=float, default=0.0, help="simulated work per step and rank (seconds)"
    )
    peers.add_argument(
        "--stall-dump-s",
        type=float,
        # 30 s: above a checkpoint save's time here, and with GPU Medic's 15 s to gather the ranks'
        # reports, a hang is named within a minute (docs/culprit.md). 0 turns the watch off.
        default=float(env("MEDIC_STALL_DUMP_S", "30")) or None,
        help="dump every thread's stack and report it once no step ended for this long, 0: never "
        "(default 30, env MEDIC_STALL_DUMP_S)",
    )
    peers.add_argument(
        "--artifacts",
        type=Path,
        default=Path(env("MEDIC_ARTIFACTS", "medic-artifacts")),
        help="where stack dumps and profiles go, and profile requests are looked for (env MEDIC_ARTIFACTS)",
    )
    peers.add_argument(
        "--profile-steps",
        type=int,
        default=int(env("MEDIC_PROFILE_STEPS", "3")),
        help="profile this many steps of a rank whose own work slowed, or that a request file asks about; "
        "0: never (env MEDIC_PROFILE_STEPS)",
    )
    slow = parser.add_argument_group("slowdown and hang injection")
    slow.add_argument(
        "--slow-rank", type=int, help="this rank's simulated work is --slow-factor times longer"
    )
    slow.add_argument(
        "--slow-all", action="store_true", help="every rank's work is --slow-factor times longer"
    )
    slow.add_argument("--slow-factor", type=float, default=1.3)
    slow.add_argument("--slow-from-step", type=int, default=1)
    slow.add_argument("--hang-rank", type=int, help="this rank stops before --hang-at-step's collective")
    slow.add_argument("--hang-at-step", type=int)
    slow.add_argument(
        "--hang-all-at-step",
        type=int,
        help="every rank stops inside this step's first collective, as when a link between them fails; "
        "only in the job's first attempt (a restart or a requeue trains on)",
    )
    cause = parser.add_argument_group(
        "a named cause of slowness on one rank (docs/culprit.md, the profile diff)"
    )
    cause.add_argument(
        "--inject-slow",
        choices=INJECTED_CAUSES,
        help="compute: every addmm (the forward's matmul) runs --inject-ms longer; copy: every host copy of "
        "the batch does; input: the data loader sleeps --inject-ms per batch; python: the named function "
        "injected_hot_spot busy-loops --inject-ms per step",
    )
    cause.add_argument("--inject-rank", type=int, default=0, help="the rank --inject-slow slows")
    cause.add_argument("--inject-ms", type=float, default=4.0)
    args = parser.parse_args(argv)
    if args.fail_during_save and (args.fail_at_step is None or args.fail_at_step % args.ckpt_every):
        parser.error("--fail-during-save needs a --fail-at-step that is a checkpoint step")
    if (args.hang_rank is None) != (args.hang_at_step is None):
        parser.error("--hang-rank and --hang-at-step go together")
    return args


def node_name(node_of_rank: str | None, rank: int) -> str:
    if not node_of_rank:
        # Under Slurm, the scheduler's name for the node: what GPU Medic drains and requeues around.
        return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    names = node_of_rank.split(",")
    if len(names) <= rank:
        raise SystemExit(f"--node-of-rank names {len(names)} ranks; rank {rank} has none")
    return names[rank]


def simulated_work(args: argparse.Namespace, step: int, rank: int) -> float:
    """Seconds of stand-in work this step: a slow GPU or input pipeline, made to order."""
    slowed = step >= args.slow_from_step and (args.slow_all or rank == args.slow_rank)
    return args.step_work_s * (args.slow_factor if slowed else 1.0)


def injected_hot_spot(seconds: float) -> None:
    """The `python` cause: a named Python function that holds the CPU for `seconds` in its own code,
    as a hot spot in a job's Python would."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(2_000):  # pure bytecode between clock reads: the time is this frame's own
            pass


class StepBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The batch of step s at index s: read through a DataLoader, as a job reads its input. `starve_s`
    is the `input` cause: a data loader that keeps this rank waiting."""

    def __init__(self, seed: int, size: int, rank: int, world: int, starve_s: float = 0.0) -> None:
        self.seed, self.size, self.rank, self.world, self.starve_s = seed, size, rank, world, starve_s

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.starve_s:
            time.sleep(self.starve_s)
        return batch(self.seed, step, self.size, self.rank, self.world)


def slow_kernels(cause: str, seconds: float) -> torch.library.Library:
    """The `compute` and `copy` causes: the same operator at the same shapes, slower, as on a slow GPU
    or a slow PCIe link. The CPU kernel of addmm (or of the copy that `.to` makes) is replaced with one
    that does the same work, then repeats it for `seconds` more, a call: the profile shows the same
    calls, each one longer. Keep the returned library: the override lasts as long as it lives."""
    library = torch.library.Library("aten", "IMPL")

    def repeat(work: Callable[[], object]) -> None:
        work()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            work()

    if cause == "compute":

        def addmm(
            bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1
        ) -> torch.Tensor:
            out = a.new_empty((a.shape[0], b.shape[1]))
            # The out= overload keeps its own CPU kernel: the same arithmetic, bit for bit.
            repeat(lambda: torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=out))
            return out

        library.impl("addmm", addmm, "CPU")
    else:

        def to_copy(
            tensor: torch.Tensor | float,
            *,
            dtype: torch.dtype | None = None,
            device: torch.device | None = None,
            **_: object,  # layout, pinning, memory format: the defaults serve these copies
        ) -> torch.Tensor:
            if not isinstance(
                tensor, torch.Tensor
            ):  # a Python number in arithmetic (0.1 * x) comes as itself
                return torch.scalar_tensor(tensor, dtype=dtype, device=device)
            out = torch.empty_like(tensor, dtype=dtype or tensor.dtype, device=device or tensor.device)
            if tensor.dim():
                repeat(lambda: out.copy_(tensor))
            else:  # a scalar's copy (Adam's step count) moves no data: a slow link is no slower at it
                out.copy_(tensor)
            return out

        library.impl("_to_copy", to_copy, "CPU")
    return library


def first_attempt() -> bool:
    """Neither torchrun nor Slurm has restarted the job."""
    return all(
        os.environ.get(name, "0") == "0" for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    )


def count_collectives(
    hooks: MedicHooks, hang_at_step: int | None = None
) -> Callable[[object, dist.GradBucket], Future[torch.Tensor]]:
    """DDP's own all-reduce, telling the hooks as this rank enters each one; with `hang_at_step`, it
    never comes back from that step's first (in a first attempt)."""
    hang = hang_at_step is not None and first_attempt()

    # Unannotated: DDP checks annotations against the real classes, and here they would be strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        hooks.collective()
        if hang and (hooks.last_step or 0) + 1 == hang_at_step:
            time.sleep(24 * 3600)  # inside the collective on every rank: no rank is behind
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # no state: the default group

    return hook


def die(hooks: MedicHooks) -> NoReturn:
    """Die like a crashed process: report, then exit without any teardown; the launcher sees the code."""
    hooks.crash(FAULT_EXIT_CODE)
    os._exit(FAULT_EXIT_CODE)


class DyingWriter(dcp.FileSystemWriter):
    """Writes this rank's shard files, then dies before the coordinator can write `.metadata`."""

    def __init__(self, path: Path, hooks: MedicHooks) -> None:
        super().__init__(str(path))
        self.hooks = hooks

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner)
        written.wait()
        die(self.hooks)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)
    )


def batch(seed: int, step: int, size: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step `step`'s global batch, which depends only on (seed, step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, FEATURES, generator=generator)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(size, 1, generator=generator)
    per_rank = size // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows], y[rows]


def grads_finite(model: nn.Module) -> bool:
    # DDP all-reduces gradients, so every rank reaches the same verdict without another collective.
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def resume_step(ckpt_dir: Path, rank: int) -> int:
    """The newest complete checkpoint's step (0 for none), decided by rank 0 for everyone."""
    found: list[int | None] = [None]
    if rank == 0:
        latest = latest_complete(ckpt_dir)
        found = [latest[0] if latest else 0]
    dist.broadcast_object_list(found, src=0)
    step = found[0]
    assert step is not None  # rank 0 always fills it in before the broadcast
    return int(step)


def save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: Path,
    rank: int,
    writer: dcp.FileSystemWriter | None = None,
) -> None:
    if rank == 0 and folder.exists():
        shutil.rmtree(folder)  # a leftover of an interrupted run: never mix its shards with ours
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optim": optim_state},
        checkpoint_id=str(folder),
        storage_writer=writer or dcp.FileSystemWriter(str(folder)),
    )


def load(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)
    # Any: dcp.load fills in whatever state dict it is given, in place, entries included.
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def train(
    args: argparse.Namespace,
    hooks: MedicHooks,
    rank: int,
    world: int,
    device: torch.device,
    timeline: dict[str, float],
) -> None:
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} does not split over {world} ranks")
    torch.manual_seed(args.seed)
    model = make_model().to(device)
    ddp = DistributedDataParallel(model)
    # Always: where each rank is in its collectives is what names a hang (its stall reports), and
    # counting them is an integer a bucket.
    ddp.register_comm_hook(None, count_collectives(hooks, args.hang_all_at_step))
    # Adam's moment estimates are state too: resuming them is part of what the checkpoint proves.
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2)

    start = resume_step(args.ckpt_dir, rank)
    if start:
        load(ddp, optimizer, args.ckpt_dir / step_dir_name(start))
        timeline["loaded"] = time.time()
        print(f"rank {rank}: resumed from step {start} ({args.ckpt_dir})", flush=True)

    injected = args.inject_slow if rank == args.inject_rank else None
    inject_s = args.inject_ms / 1000
    override = slow_kernels(injected, inject_s) if injected in ("compute", "copy") else None
    starve_s = inject_s if injected == "input" else 0.0
    dataset = StepBatches(args.seed, args.batch_size, rank, world, starve_s)
    # batch_size=None: each index is a whole batch already; the steps are the indices, in order.
    batches = iter(DataLoader(dataset, batch_size=None, sampler=range(start + 1, args.steps + 1)))
    args.loss_log.parent.mkdir(parents=True, exist_ok=True)
    with args.loss_log.open("a") as losses, StepProfiler(hooks, device) as profiler:
        for step in range(start + 1, args.steps + 1):
            profiler.before(step)  # outside the step's time: starting a profiler is no work of the step
            began = time.perf_counter()
            fault_here = step == args.fail_at_step and rank == args.fail_rank
            if fault_here and not args.fail_during_save:
                die(hooks)
            if step == args.hang_at_step and rank == args.hang_rank:
                time.sleep(24 * 3600)  # hung before the step's collective; the others time out
            time.sleep(simulated_work(args, step, rank))
            x, y = next(batches)  # inside the step: waiting for input is the step's time
            if injected == "python":
                injected_hot_spot(inject_s)
            # copy=True: a real host copy on the CPU too, where .to() would hand back the same tensor, so
            # that every device's profile has its copies (the `copy` cause slows them).
            x, y = x.to(device, copy=True), y.to(device, copy=True)
            loss = nn.functional.mse_loss(ddp(x), y)
            if step == args.nan_at_step and rank == args.fail_rank:
                loss = loss * float("nan")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grads_finite(ddp):
                optimizer.step()  # a NaN step is skipped on every rank alike, like AMP's loss scaler does
            value: float = loss.item()  # a float tensor's item is a Python float
            # The save is left out of the step time: a checkpoint step is slow by design, not a straggler.
            hooks.step(step, value, time.perf_counter() - began)
            profiler.after(step)
            line = {"step": step, "rank": rank, "world_size": world, "loss": value.hex()}
            losses.write(json.dumps(line) + "\n")
            losses.flush()
            if start and step == start + 1 and rank == 0:
                # Where a restart's time went, from the process's start to training again (tests/bench/resume.py).
                timeline["first_step"] = time.time()
                print(f"rank 0: resume timeline {json.dumps(timeline)}", flush=True)
            if step % args.ckpt_every == 0:
                folder = args.ckpt_dir / step_dir_name(step)
                save(ddp, optimizer, folder, rank, DyingWriter(folder, hooks) if fault_here else None)
    del override  # the slowed kernel goes with it (a resumed run in this process is healthy again)


def pick_device(wanted: str, local_rank: int, local_world: int, gpus: int) -> torch.device:
    """One GPU per rank, or the CPU for every rank: more ranks than visible GPUs would otherwise crash
    the extra ones with "invalid device ordinal" (seen with 2 ranks on a 1-GPU host)."""
    if wanted == "cpu" or (wanted == "auto" and gpus < local_world):
        return torch.device("cpu")
    if gpus < local_world:
        raise SystemExit(
            f"--device cuda needs {local_world} GPUs on this node (one per rank); {gpus} visible"
        )
    return torch.device("cuda", local_rank)


def attempt_store(rank: int, world: int) -> dist.Store:
    """torchrun's store, with this attempt's keys apart from those of the attempts before it.

    torchrun shares its agent's store with the workers by default and keeps it across the restarts
    of `--max-restarts`, and the process group writes the same keys each time: a restarted rank can
    read a dead peer's address, and gloo's connect then fails or hangs (11 of 15 restarts of 2 CPU
    ranks, torch 2.13, static and c10d rendezvous alike). The restart count tells attempts apart
    only under one agent: with several (one per node), the agent whose worker died counts a restart
    and the others, restarted by the new rendezvous round, do not, so their ranks would wait on
    different keys for ever. train.sbatch therefore turns the sharing off
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): each attempt then gets a store of its own, with nothing
    stale in it.
    """
    store, _, _ = next(dist.rendezvous("env://", rank, world))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def main(argv: Sequence[str] | None = None) -> int:
    timeline = {"started": STARTED, "imported": time.time()}
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = pick_device(args.device, local_rank, local_world, torch.cuda.device_count())
    torch.use_deterministic_algorithms(True)
    # None: the backend's default, as when no timeout is passed.
    timeout = timedelta(seconds=args.collective_timeout_s) if args.collective_timeout_s else None
    store = attempt_store(rank, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # Bound to its device up front, NCCL creates its communicator eagerly and warns of no guess.
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world, timeout=timeout, device_id=device
        )
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    timeline["joined"] = time.time()
    hooks = MedicHooks(
        job=args.job,
        node=node_name(args.node_of_rank, rank),
        rank=rank,
        sink=args.events,
        gpu=local_rank if device.type == "cuda" else None,
        world_size=world,
        timings_every=args.timings_every,
    )
    if args.stall_dump_s:
        hooks.watch_for_stalls(args.stall_dump_s, args.artifacts)
    if args.profile_steps:
        hooks.profile_on_demand(args.artifacts, steps=args.profile_steps)
    with hooks.watch():
        train(args, hooks, rank, world, device, timeline)
    # No rank may tear the group down while another is still in its last save: that aborted
    # the slower rank (SIGABRT) now and then.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    # Every step, checkpoint and line is written by now. Interpreter teardown can still destroy a
    # gloo thread that is winding down, and C++ then aborts the rank (SIGABRT, "terminate called
    # without an active exception"), failing a job that finished: end without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
