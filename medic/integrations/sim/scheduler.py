"""A `Scheduler` over the simulated fleet, with Slurm's semantics for drains, requeues and a sweep's
reservations (a busy node is refused; no requeued job lands on a reserved node)."""

from __future__ import annotations

from collections.abc import Sequence

from medic.integrations.sim.fleet import SimFleet, SimJob
from medic.protocols import SPARES_RESERVATION, JobInfo, JobState, NodeInfo, NodeState
from medic.sweep import RESERVATION_PREFIX, NodeBusyError


class SimScheduler:
    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def _info(self, name: str) -> NodeInfo:
        node = self.fleet.node(name)
        return NodeInfo(
            node.name,
            node.state,
            node.reason,
            node.switch,
            node.gpus,
            partitions=node.partitions,
            features=node.features,
            gpu_model=node.gpu_model,
        )

    def nodes(self) -> list[NodeInfo]:
        with self.fleet.lock:
            return [self._info(name) for name in sorted(self.fleet.nodes)]

    def node(self, name: str) -> NodeInfo:
        with self.fleet.lock:
            return self._info(name)

    @staticmethod
    def _job_info(job: SimJob) -> JobInfo:
        return JobInfo(job.id, job.state, tuple(job.nodes), job.owner, job.step, job.restarts)

    def job(self, job_id: str) -> JobInfo | None:
        with self.fleet.lock:
            job = self.fleet.jobs.get(job_id)
            if job is None:
                return None
            self.fleet.advance(job)
            return self._job_info(job)

    def jobs_on_node(self, name: str) -> list[JobInfo]:
        with self.fleet.lock:
            self.fleet.node(name)  # an unknown node is an error, as with Slurm
            return [self._job_info(j) for j in self.fleet.jobs.values() if name in j.nodes]

    def drain(self, name: str, reason: str) -> None:
        if not reason:
            raise ValueError("a drain needs a reason")
        with self.fleet.lock:
            self.fleet.record_call(name, "drain")
            node = self.fleet.node(name)
            if node.state is not NodeState.DOWN:
                node.state = NodeState.DRAINED
            node.reason = reason

    def resume(self, name: str) -> None:
        with self.fleet.lock:
            self.fleet.record_call(name, "resume")
            node = self.fleet.node(name)
            if node.state not in (NodeState.DRAINED, NodeState.DOWN):
                raise ValueError(f"{name} is {node.state.value}, not drained: nothing to resume")
            busy = any(name in j.nodes and j.state is JobState.RUNNING for j in self.fleet.jobs.values())
            node.state = NodeState.ALLOCATED if busy else NodeState.IDLE
            node.reason = None

    def requeue(self, job_id: str, exclude: list[str]) -> JobInfo:
        """Restart the job from its last checkpoint on the same number of healthy nodes."""
        with self.fleet.lock:
            self.fleet.record_call(job_id, "requeue")
            job = self.fleet.jobs[job_id]
            keep = [n for n in job.nodes if n not in exclude]
            spare = [
                n.name
                for n in self.fleet.nodes.values()
                if n.state is NodeState.IDLE
                and n.name not in exclude
                and n.name not in keep
                and n.name not in self._reserved()
            ]
            needed = len(job.nodes) - len(keep)
            if len(spare) < needed:
                raise RuntimeError(f"job {job_id}: {needed} spare nodes needed, {len(spare)} idle")
            for name in spare[:needed]:
                self.fleet.nodes[name].state = NodeState.ALLOCATED
            left = [n for n in job.nodes if n not in keep]
            job.nodes = keep + spare[:needed]
            job.step = job.last_checkpoint[0] if job.last_checkpoint else 0
            job.state = JobState.RUNNING
            job.restarts += 1
            self._free(left)
            return self._job_info(job)

    def readmit(self, job_id: str, node: str) -> bool:
        """Nothing to lift: a simulated requeue starts the job at once or fails, it never waits."""
        return False

    def reserve(self, nodes: Sequence[str], minutes: int, reason: str) -> str:
        with self.fleet.lock:
            busy = {n for j in self.fleet.jobs.values() if j.state is JobState.RUNNING for n in j.nodes}
            for wanted in nodes:
                node = self.fleet.node(wanted)
                if wanted in busy or node.state is not NodeState.IDLE or wanted in self._reserved():
                    raise NodeBusyError(wanted, f"it is {node.state.value} or already reserved")
            # Unique while held, as a node is in one reservation at most.
            name = f"{RESERVATION_PREFIX}sim-{'-'.join(nodes)}"
            for node_name in nodes:
                self.fleet.record_call(node_name, "reserve")
            self.fleet.reservations[name] = tuple(nodes)
            return name

    def release(self, name: str) -> None:
        with self.fleet.lock:
            for node_name in self.fleet.reservations.pop(name, ()):
                self.fleet.record_call(node_name, "release")

    def reserved_nodes(self) -> frozenset[str]:
        """The sweeps' (as Slurm's): the spare pool is no sweep's, and its nodes are in service."""
        with self.fleet.lock:
            return frozenset(
                n
                for name, nodes in self.fleet.reservations.items()
                if name.startswith(RESERVATION_PREFIX)
                for n in nodes
            )

    def spare_nodes(self) -> frozenset[str]:
        with self.fleet.lock:
            return frozenset(self.fleet.reservations.get(SPARES_RESERVATION, ()))

    def lend(self) -> str | None:
        with self.fleet.lock:
            pool = sorted(self.fleet.reservations.get(SPARES_RESERVATION, ()))
            if not pool:
                return None
            self.fleet.record_call(pool[0], "lend")
            if pool[1:]:
                self.fleet.reservations[SPARES_RESERVATION] = tuple(pool[1:])
            else:
                del self.fleet.reservations[SPARES_RESERVATION]
            return pool[0]

    def refill(self, node: str) -> None:
        with self.fleet.lock:
            self.fleet.node(node)  # a node the fleet has
            pool = set(self.fleet.reservations.get(SPARES_RESERVATION, ()))
            if node not in pool:
                self.fleet.record_call(node, "refill")
                self.fleet.reservations[SPARES_RESERVATION] = tuple(sorted(pool | {node}))

    def _reserved(self) -> frozenset[str]:
        return frozenset(n for nodes in self.fleet.reservations.values() for n in nodes)

    def _free(self, names: list[str]) -> None:
        """Nodes a requeued job left go idle once no running job holds them, as Slurm frees them; a
        drained, down or rebooting one stays as it is."""
        busy = {n for j in self.fleet.jobs.values() if j.state is JobState.RUNNING for n in j.nodes}
        for name in names:
            node = self.fleet.nodes[name]
            if name not in busy and node.state is NodeState.ALLOCATED:
                node.state = NodeState.IDLE
