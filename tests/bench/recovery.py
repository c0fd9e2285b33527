"""Fault to training stepping again, end to end, on a real Slurm cluster: the headline of recovery.

`PYTHONPATH=tests python -m bench.recovery [RUNS]` prints a markdown section. A real local Slurm cluster of 3 nodes
(scripts/slurm-cluster.sh) runs the reference job (medic/training/train.sbatch: torchrun on
the CPU, one rank on each of 2 nodes, a DCP checkpoint every 10 steps). `medic serve` (the warm
path, Prefect embedded, SQLite) drains, requeues and reboots through `scontrol`; DCGM and chat
are simulated. The third node is a spare held by the `medic-spares` reservation, or else busy
with another job, so that the cluster is full: with no spare, the requeued job waits for the
repaired node.

Each run: once step 12 is logged, one rank of the job is killed (SIGKILL) and the fault event is
POSTed at the same instant: XID 13 (the application's fault: the node stays, torchrun restarts the
group in place), XID 48 (the GPU is reset; the job is requeued off the node and waits for it),
XID 79 with a spare (the job is requeued onto the spare at once) and XID 79 without one (it waits
for the reboot). Or (e) no event is POSTed: every rank stops inside step 12's first collective
(`--hang-all-at-step`, a stand-in for a link that fails between them: the ranks see the same), and
their own stall reports (the job's stall watch at its default 30 s, forwarded to `medic serve` as
they are written) are all GPU Medic hears; the job is requeued onto its own nodes. There the fault's
time is the ranks' last progress, as their stall reports give it. Measured: the job's first
completed step after the fault. The phases come from
the store (incident opened, decision, drain, requeue), from Slurm (the job running again, polled
every 0.1 s) and from the timeline train.py prints on its first step after a resume. A run of
all four rewrites medic/data/recovery-measured.json, the simulator's measured profile.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.flow_overhead import POLICY
from bench.live import Server, epoch, event_dict, slurm_cluster
from bench.report import Stats, machine_line, num, table
from bench.resume import TIMELINE
from medic.integrations.processes import free_port
from medic.peers import SOURCE
from medic.shipped import TRAIN_SCRIPT
from medic.tasks.resume import RESTART

NODES = 3
JOB_NODES = 2
GPUS = 8  # scripts/slurm-cluster.sh's gres per node
CKPT_EVERY = 10
KILL_AT_STEP = 12  # step 10's checkpoint is complete once step 11 is logged
STEP_WORK_S = 0.1
STEPS = 100_000  # never finishes by itself: each run cancels it after its first step back
RUN_TIMEOUT_S = 300.0
POLL_S = 0.1
CRED_EXPIRE_S = 10  # scripts/slurm-cluster.sh; Slurm's default is 120 s
SBATCH = TRAIN_SCRIPT.parent / "train.sbatch"
# The rules a node faulted ten times in a row meets: a repeat offender is diagnosed, escalated or
# replaced, which is right for a fleet; each run here measures a first fault.
REPEAT_RULES = (
    "repeat-offender-escalate",
    "repeat-offender-replace",
    "fatal-xid-repeat-gpu",
    "application-signature-across-jobs-on-gpu",
)


@dataclass(frozen=True, slots=True)
class Scenario:
    key: str
    title: str
    xid: int | None  # None: the ranks hang, and their own reports are the only events
    action: str  # what the default policy decides for it
    spare: bool  # the third node is a spare (else another job keeps it busy)


SCENARIOS = (
    Scenario("in-place", "(a) restart in place", 13, "none", spare=False),
    Scenario("reset", "(b) GPU reset", 48, "reset_gpu", spare=False),
    Scenario("spare", "(c) requeue onto a spare", 79, "reboot", spare=True),
    Scenario("no-spare", "(d) requeue, no spare", 79, "reboot", spare=False),
    Scenario("hang", "(e) every rank hung in one collective", None, "none", spare=False),
)


def slurm(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=30).stdout


def job_state(job_id: str) -> str:
    found = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    return found or "GONE"


def job_nodes(job_id: str) -> list[str]:
    hostlist = slurm("squeue", "-h", "-j", job_id, "-o", "%N").strip()
    return slurm("scontrol", "show", "hostnames", hostlist).split() if hostlist else []


def rank_on(node: str) -> int:
    """The training process (not torchrun's agent) that Slurm runs on `node`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # exited while we looked
        if (
            str(TRAIN_SCRIPT).encode() in argv
            and b"torch.distributed.run" not in argv
            and f"SLURMD_NODENAME={node}".encode() in environ
        ):
            return int(entry.name)
    raise RuntimeError(f"no rank of the job on {node}")


def logged_step(losses: Path) -> int:
    if not losses.exists():
        return 0
    return max((json.loads(line)["step"] for line in losses.read_text().splitlines() if line), default=0)


def timelines(output: Path) -> list[dict[str, float]]:
    return [json.loads(found) for found in TIMELINE.findall(output.read_text())] if output.exists() else []


def until(check: Any, what: str, timeout_s: float = RUN_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return found


def bench_policy(directory: Path, spares: int) -> Path:
    import yaml

    data = yaml.safe_load(POLICY.read_text(encoding="utf-8"))
    data["guardrails"] = {}
    data["rules"] = [r for r in data["rules"] if r["id"] not in REPEAT_RULES]
    # A run's fault is a new one, not a copy of the run before's (decision 0013): each run faults the
    # next GPU, and the window that makes a burst one incident is shorter than a run.
    data["defaults"]["incident_window_minutes"] = 1
    if spares:
        data["spares"] = {"nodes": spares}
    path = directory / "policy.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@dataclass
class Bench:
    scenario: Scenario
    server: Server
    root: Path  # per-run folders; checkpoints/JOB links each job's checkpoints for MEDIC_CHECKPOINTS

    def submit(self, run: int) -> tuple[str, Path]:
        workdir = self.root / f"{self.scenario.key}-{run}"
        workdir.mkdir()
        env = {
            "TRAIN_PYTHON": sys.executable,
            "TRAIN_DIR": str(TRAIN_SCRIPT.parent),
            "TRAIN_NPROC_PER_NODE": "1",
            "TRAIN_MAX_RESTARTS": "3",
            "TRAIN_RDZV_PORT": str(free_port()),
            "TRAIN_DEVICE": "cpu",
            "OMP_NUM_THREADS": "1",
        }
        job_id = slurm(
            "sbatch",
            "--parsable",
            f"--nodes={JOB_NODES}",
            "--exclusive",
            f"--chdir={workdir}",
            f"--output={workdir / 'job.out'}",
            f"--export=ALL,{','.join(f'{k}={v}' for k, v in env.items())}",
            str(SBATCH),
            f"--steps={STEPS}",
            f"--ckpt-every={CKPT_EVERY}",
            f"--ckpt-dir={workdir / 'checkpoints'}",
            f"--loss-log={workdir / 'losses.jsonl'}",
            f"--events={workdir / 'events.jsonl'}",
            f"--step-work-s={STEP_WORK_S}",
            *([f"--hang-all-at-step={KILL_AT_STEP}"] if self.scenario.xid is None else []),
        ).strip()
        (self.root / "checkpoints" / job_id).symlink_to(workdir / "checkpoints")
        return job_id, workdir

    def once(self, run: int) -> dict[str, float]:
        from medic.store import Store

        job_id, workdir = self.submit(run)
        forwarder = _Forwarder(workdir / "events.jsonl", self.server) if self.scenario.xid is None else None
        try:
            until(
                lambda: logged_step(workdir / "losses.jsonl") >= KILL_AT_STEP - 1, f"step {KILL_AT_STEP - 1}"
            )
            nodes = job_nodes(job_id)
            fault = time.time()
            if forwarder is None:
                os.kill(rank_on(nodes[0]), signal.SIGKILL)
                event = event_dict(f"{self.scenario.key}-{run}", "xid", nodes[0], gpu=run % GPUS, job=job_id)
                self.server.post([event | {"attributes": {"code": self.scenario.xid}}])
            else:
                forwarder.start()
            running_again = self._watch(job_id, workdir, fault)
            store = Store(self.server.database)
            try:
                details = [self._detail(store, node, fault) for node in (nodes if forwarder else nodes[:1])]
            finally:
                store.close()
        finally:
            if forwarder is not None:
                forwarder.stop()
            slurm("scancel", job_id)
            until(lambda: job_state(job_id) == "GONE", f"job {job_id} gone", timeout_s=120)
        if forwarder is not None:
            fault = forwarder.onset()  # the ranks' last progress: the hang's own moment
        marks = self._first_step(workdir, fault, running_again)
        if marks is None:
            raise RuntimeError(f"no first step after the fault in {workdir / 'job.out'}")
        if {d.incident.action for d in details} != {self.scenario.action}:
            raise RuntimeError(
                f"decided {[d.incident.action for d in details]}, expected {self.scenario.action}"
            )
        if forwarder is not None:
            return self._hang_phases(fault, details, running_again, marks)
        return self._phases(fault, details[0], running_again, marks)

    def _detail(self, store: Any, node: str, fault: float) -> Any:
        """The closed incident the fault opened on `node`: for a hang, the one GPU Medic's derived
        event opened (a loaded machine can make the job report a slow step of its own beside it)."""

        def closed() -> Any:
            found = [i for i in store.find_incidents(node=node) if epoch(i.opened_at) >= fault - 1]
            details = [store.incident_detail(i.id) for i in found if i.closed_at]
            hang = self.scenario.xid is None
            return next((d for d in details if d and (not hang or _derived(d))), None)

        return until(closed, f"closed incident on {node}")

    def _watch(self, job_id: str, workdir: Path, fault: float) -> float | None:
        """Until the first step after the fault; when Slurm ran the job again, if it was requeued."""
        left = running = None
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            state = job_state(job_id)
            if state != "RUNNING" and left is None:
                left = time.time()
            elif state == "RUNNING" and left is not None and running is None:
                running = time.time()
            if self._first_step(workdir, fault, running):
                return running
            time.sleep(POLL_S)
        raise TimeoutError(f"job {job_id} took no step within {RUN_TIMEOUT_S:.0f} s of the fault")

    def _first_step(self, workdir: Path, fault: float, running: float | None) -> dict[str, float] | None:
        """The timeline of the launch that trained again: in place, the first after the fault; after a
        requeue, the first Slurm started again (not torchrun's restart on the bad node before it)."""
        if self.scenario.action != "none" and running is None:
            return None
        since = fault if running is None else running
        return next((t for t in timelines(workdir / "job.out") if t["started"] > since), None)

    @staticmethod
    def _hang_phases(
        onset: float, details: list[Any], running_again: float | None, marks: dict[str, float]
    ) -> dict[str, float]:
        """A hang's phases, over the incidents it opened (one per node of the job)."""
        if running_again is None:
            raise RuntimeError("the hung job was never requeued")
        stored = min(epoch(e.received_at) for d in details for e in d.events if e.source == SOURCE)
        decided = min(epoch(d.decided_at) for detail in details for d in detail.decisions)
        [restarted] = [
            epoch(a.finished_at) for d in details for a in d.actions if a.action == RESTART and a.finished_at
        ]
        return {
            "detect": stored - onset,
            "decide": decided - stored,
            "restart": restarted - decided,
            "schedule": running_again - restarted,
            "launch": marks["imported"] - running_again,
            "load": marks["loaded"] - marks["imported"],
            "first_step": marks["first_step"] - marks["loaded"],
            "total": marks["first_step"] - onset,
        }

    def _phases(
        self, fault: float, detail: Any, running_again: float | None, marks: dict[str, float]
    ) -> dict[str, float]:
        stored = min(epoch(e.received_at) for e in detail.events)
        decided = min(epoch(d.decided_at) for d in detail.decisions)
        phases = {"detect": stored - fault, "decide": decided - stored}
        if running_again is None:  # restarted in place: GPU Medic is off the path
            phases["torchrun_restart"] = marks["started"] - fault
            phases["launch"] = marks["imported"] - marks["started"]
        else:
            actions = {a.action: epoch(a.finished_at) for a in detail.actions if a.finished_at}
            phases["contain"] = actions["drain"] - decided
            phases["requeue"] = actions["requeue"] - actions["drain"]
            phases["schedule"] = running_again - actions["requeue"]
            if (
                "resume" in actions
            ):  # the node repaired, verified and back: what a job with no spare waits for
                phases["repair"] = actions["resume"] - actions["requeue"]
            phases["launch"] = marks["imported"] - running_again
        phases["load"] = marks["loaded"] - marks["imported"]
        phases["first_step"] = marks["first_step"] - marks["loaded"]
        phases["total"] = marks["first_step"] - fault
        return phases


def _derived(detail: Any) -> bool:
    return any(e.source == SOURCE for e in detail.events)


class _Forwarder:
    """The job's own events, POSTed to `medic serve` as they are written: what a node's forwarder does
    with a job that writes its events to a file."""

    def __init__(self, path: Path, server: Server) -> None:
        self.path, self.server = path, server
        self.offset = 0
        self.stalls: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-forwarder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def onset(self) -> float:
        """The ranks' last progress before they stalled: each stall report's time less its `stalled_s`."""
        if not self.stalls:
            raise RuntimeError(f"no stall report in {self.path}")
        return max(
            datetime.fromisoformat(e["time"]).timestamp() - float(e["attributes"]["stalled_s"])
            for e in self.stalls
        )

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if not self.path.exists():
                continue
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                text = handle.read()
            complete = text[: text.rfind(b"\n") + 1]
            self.offset += len(complete)
            events = [json.loads(line) for line in complete.decode().splitlines() if line]
            if events:
                self.stalls += [e for e in events if e.get("attributes", {}).get("check") == "stall"]
                self.server.post(events)


@contextmanager
def serving(scenario: Scenario, directory: Path) -> Iterator[Bench]:
    """A real Slurm cluster, the third node a spare or busy, and `medic serve` on it."""
    with slurm_cluster(NODES) as conf:
        os.environ["SLURM_CONF"] = str(conf)
        third = f"gpu-node-{NODES}"
        if scenario.spare:
            from medic.integrations.slurm import SlurmScheduler

            SlurmScheduler().refill(third)
        else:
            slurm("sbatch", f"--nodelist={third}", "--output=/dev/null", "--wrap", "sleep 100000")
        (directory / "checkpoints").mkdir()
        policy = bench_policy(directory, 1 if scenario.spare else 0)
        env = {
            "MEDIC_BACKENDS": "sim",  # DCGM, chat; the scheduler and the provider are Slurm
            "MEDIC_SCHEDULER": "slurm",
            "MEDIC_PROVIDER": "slurm",
            "MEDIC_GPU_RESET": "sim",  # no GPU here: the reset itself is simulated and instant
            "MEDIC_CHECKPOINTS": str(directory / "checkpoints"),
            "MEDIC_POLICY": str(policy),
            "SLURM_CONF": str(conf),
        }
        medic = [str(Path(sys.executable).parent / "medic"), "serve", "--log-level", "warning"]
        with Server(directory, NODES, NODES, policy, command=medic, extra_env=env) as server:
            yield Bench(scenario, server, directory)


def run(runs: int = 10, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    results: dict[str, Any] = {
        "runs": runs,
        "load": [os.getloadavg()[0]],
        "scenarios": {},
        "machine": machine_line(os.cpu_count() or 1),
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    for scenario in [s for s in SCENARIOS if not keys or s.key in keys]:
        directory = Path(tempfile.mkdtemp(prefix=f"medic-bench-recovery-{scenario.key}-"))
        directory.chmod(0o755)
        try:
            with serving(scenario, directory) as bench:
                bench.once(0)  # warm-up: the server's first flow and checkpoint read, not counted
                samples = []
                for i in range(1, runs + 1):
                    samples.append(bench.once(i))
                    print(f"{scenario.key} {i}: {samples[-1]}", file=sys.stderr, flush=True)
            results["scenarios"][scenario.key] = samples
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        results["load"].append(os.getloadavg()[0])
    if results["scenarios"]:  # the simulator's measured profile
        found = measured(results)
        if set(results["scenarios"]) != {s.key for s in SCENARIOS}:
            found = merged(json.loads(MEASURED.read_text(encoding="utf-8")), found)
        MEASURED.write_text(json.dumps(found, indent=2) + "\n", encoding="utf-8")
    return results


def merged(shipped: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The shipped measurement with the paths of a partial run put in, each run's when and where kept."""
    paths = ", ".join(new["paths"])
    return shipped | {
        "measured_at": f"{shipped['measured_at']}; {paths}: {new['measured_at']}",
        "machine": f"{shipped['machine']}; {paths}: {new['machine']}",
        "load": shipped["load"] + new["load"],
        "runs": min(shipped["runs"], new["runs"]),
        "paths": shipped["paths"] | new["paths"],
    }


# The phases in the order they happen, as the table names them.
PHASES = {
    "detect": "GPU Medic: the fault event POSTed and stored",
    "decide": "GPU Medic: decided",
    "contain": "contain: the node drained",
    "requeue": "requeue: `scontrol requeuehold`, exclusion, release",
    "restart": "restart: DCGM L1 on each node, the hung job requeued onto them",
    "schedule": "schedule: Slurm runs the job again",
    "repair": "repair: reset or reboot, DCGM L1, back in service (within schedule)",
    "torchrun_restart": "torchrun: the dead rank seen, the group restarted",
    "launch": "launch: srun, torchrun, the workers' imports",
    "load": "load: process group, DCP checkpoint",
    "first_step": "first step",
    "total": "**fault → first step**",
}
MEASURED = Path(__file__).resolve().parents[2] / "medic" / "data" / "recovery-measured.json"


def _cell(samples: list[dict[str, float]], phase: str) -> str:
    values = [s[phase] for s in samples if phase in s]
    if not values:
        return ""
    stats = Stats.of(values)
    return f"{num(stats.median)} s ({num(stats.p95)})"


def measured(results: dict[str, Any]) -> dict[str, Any]:
    """What the simulator's `measured` profile reads (medic/data/recovery-measured.json)."""
    paths = {}
    for key, samples in results["scenarios"].items():
        stats = {phase: Stats.of([s[phase] for s in samples]) for phase in samples[0]}
        paths[key] = {
            phase: {"p50": round(st.median, 3), "p95": round(st.p95, 3)} for phase, st in stats.items()
        }
    return {
        "source": "tests/bench/recovery.py: BENCHMARKS.md, 'Fault to training stepping again, on real Slurm'",
        "measured_at": results["measured_at"],
        "machine": results["machine"],
        "load": [round(load, 2) for load in results["load"]],
        "runs": results["runs"],
        "cred_expire_s": CRED_EXPIRE_S,
        "paths": paths,
    }


def section(results: dict[str, Any]) -> str:
    found = results["scenarios"]
    shown = [s for s in SCENARIOS if s.key in found]
    rows = [
        (label, *(_cell(found[s.key], phase) for s in shown))
        for phase, label in PHASES.items()
        if any(phase in sample for s in shown for sample in found[s.key])
    ]
    headers = ("phase: p50 (p95)", *(s.title for s in shown))
    loads = ", ".join(f"{load:.1f}" for load in results["load"])
    intro = __doc__.split("\n\n", 1)[1].strip()
    return (
        "## Fault to training stepping again, on real Slurm\n\n"
        f"{intro}\n\n"
        f"{results['runs']} runs of each after a warm-up run, on {results['machine']}; load average at the "
        f"start and after each scenario: {loads}. `AuthInfo cred_expire` is {CRED_EXPIRE_S} s on this "
        "cluster.\n\n"
        f"{table(headers, rows)}\n"
    )


if __name__ == "__main__":
    # `PYTHONPATH=tests python -m bench.recovery [RUNS [SCENARIO...]]`: the section on standard output.
    print(section(run(int(sys.argv[1]) if len(sys.argv) > 1 else 10, tuple(sys.argv[2:]))))
