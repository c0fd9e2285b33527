"""The error root and who retries what (docs/decisions/0004-retry-ownership.md), on real Prefect."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from botocore.exceptions import ClientError
from prefect import Task, task
from prefect.settings import PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW, temporary_settings

from medic.errors import MedicError, PermanentError, TransientError
from medic.integrations.aws_errors import AwsApiError, api_error, node_action_error, transient
from medic.integrations.checkpoints import IncompleteCheckpoint
from medic.integrations.dcgm.parse import DcgmOutputError
from medic.integrations.dcgm.runner import RunnerConfigError
from medic.integrations.provider_errors import (
    ActionRefusedError,
    AmbiguousNodeError,
    InvalidNodeIdError,
    NodeActionError,
    ProviderError,
    UnknownNodeError,
)
from medic.integrations.registry import BackendError
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.slack.interactions import InteractionError
from medic.integrations.slack.notifier import NotifyError, NotifyRefusedError, NotifyUnavailableError
from medic.integrations.slack.signature import SignatureError
from medic.integrations.slurm import (
    NodeHeldByOthersError,
    NotRequeueableError,
    ResumeRefusedError,
    SlurmCli,
    SlurmCommandError,
    SlurmError,
    SlurmNotInstalledError,
    SlurmRejectedError,
    SlurmUnreachableError,
    UnknownJobError,
    UnknownSlurmNodeError,
    UnsupportedSlurmActionError,
)
from medic.policy import Decision, PolicyError
from medic.policy.model import DuplicateRuleId
from medic.tasks.act import act
from medic.tasks.nodes.guard import SlotBusy, SlotLimitMissing, SlotUnavailable
from medic.tasks.runtime.process import Runtime
from medic.tasks.runtime.retry import transient_only

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture(autouse=True)
def tasks_outside_a_flow() -> Iterator[None]:
    """These tasks run on their own, as Prefect allows; their logs then have no flow run to go to."""
    with temporary_settings({PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW: "ignore"}):
        yield


TRANSIENT, PERMANENT, UNKNOWN = "transient", "permanent", "unknown"


def branch(cls: type[BaseException]) -> str:
    assert issubclass(cls, MedicError), f"{cls.__name__} is not under the root"
    assert not (issubclass(cls, TransientError) and issubclass(cls, PermanentError))
    return (
        TRANSIENT
        if issubclass(cls, TransientError)
        else PERMANENT
        if issubclass(cls, PermanentError)
        else UNKNOWN
    )


# --- The tree ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "expected", "still_a"),
    [
        (ProviderError, UNKNOWN, RuntimeError),
        (NodeActionError, UNKNOWN, ProviderError),  # e.g. a read timeout: the reboot may have happened
        (UnknownNodeError, PERMANENT, LookupError),
        (InvalidNodeIdError, PERMANENT, ValueError),
        (AmbiguousNodeError, PERMANENT, ProviderError),
        (ActionRefusedError, PERMANENT, ProviderError),
        (AwsApiError, UNKNOWN, ClientError),  # still botocore's, for code written against it
        (SlurmError, UNKNOWN, ProviderError),
        (SlurmCommandError, UNKNOWN, SlurmError),  # output that is not the JSON asked for
        (SlurmUnreachableError, TRANSIENT, SlurmCommandError),
        (SlurmRejectedError, PERMANENT, SlurmCommandError),
        (SlurmNotInstalledError, PERMANENT, SlurmCommandError),
        (UnsupportedSlurmActionError, PERMANENT, SlurmError),
        (UnknownSlurmNodeError, PERMANENT, UnknownNodeError),
        (UnknownJobError, PERMANENT, LookupError),
        (NodeHeldByOthersError, PERMANENT, SlurmError),  # the owner check
        (ResumeRefusedError, PERMANENT, SlurmError),
        (NotRequeueableError, PERMANENT, SlurmError),
        (NotifyError, UNKNOWN, RuntimeError),
        (NotifyRefusedError, PERMANENT, NotifyError),
        (NotifyUnavailableError, TRANSIENT, NotifyError),
        (SlotUnavailable, UNKNOWN, RuntimeError),
        (SlotBusy, TRANSIENT, SlotUnavailable),
        (SlotLimitMissing, PERMANENT, SlotUnavailable),
        (PolicyError, PERMANENT, Exception),
        (DuplicateRuleId, PERMANENT, ValueError),  # pydantic only wraps ValueErrors raised in validators
        (BackendError, PERMANENT, ValueError),
        (RunnerConfigError, PERMANENT, ValueError),
        (DcgmOutputError, PERMANENT, ValueError),
        (IncompleteCheckpoint, PERMANENT, Exception),
        (SignatureError, PERMANENT, ValueError),
        (InteractionError, PERMANENT, ValueError),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else v,
)
def test_every_error_is_under_the_root_keeps_its_old_base_and_sits_on_at_most_one_branch(
    cls: type[BaseException], expected: str, still_a: type[BaseException]
) -> None:
    assert branch(cls) == expected
    assert issubclass(cls, still_a)


def aws(code: str, status: int | None) -> ClientError:
    response: dict = {"Error": {"Code": code, "Message": "m"}}
    if status is not None:
        response["ResponseMetadata"] = {"HTTPStatusCode": status}
    return ClientError(response, "RebootInstances")


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [
        ("ThrottlingException", 400, TRANSIENT),
        ("SomethingNew", 429, TRANSIENT),  # a 429 is throttling whatever the code
        ("InternalError", 500, TRANSIENT),
        ("ServiceUnavailable", 503, TRANSIENT),
        ("RequestTimeout", 400, TRANSIENT),  # botocore retries it too: AWS did not act
        ("ValidationException", 400, PERMANENT),
        ("InvalidInstanceID.NotFound", 400, PERMANENT),
        ("UnauthorizedOperation", 403, PERMANENT),
        ("SomethingNew", None, UNKNOWN),  # no status to go by: fail closed
    ],
)
def test_an_aws_answer_is_sorted_by_code_and_status(code: str, status: int | None, expected: str) -> None:
    error = api_error(aws(code, status))
    assert branch(type(error)) == expected
    assert isinstance(error, ClientError) and error.response["Error"]["Code"] == code


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("InvalidInstanceStatus", TRANSIENT),  # HyperPod: "wait ... before retrying"
        ("InstanceIdInUse", TRANSIENT),
        ("InternalServerError", TRANSIENT),
        ("EndpointConnectionError", TRANSIENT),  # the request never left
        ("InstanceIdNotFound", PERMANENT),
        ("ReadTimeoutError", UNKNOWN),  # sent, no answer: the reboot may have happened
        ("NotReported", UNKNOWN),
    ],
)
def test_a_hyperpod_node_outcome_is_sorted_by_its_code(code: str, expected: str) -> None:
    error = node_action_error("gpu-1", code, "m", transient(code))
    assert branch(type(error)) == expected
    assert (error.node, error.code) == ("gpu-1", code)


@pytest.mark.parametrize(
    ("args", "timeout_s", "expected"),
    [
        (["medic-no-such-command"], 5.0, SlurmNotInstalledError),
        (["sleep", "5"], 0.2, SlurmUnreachableError),
        (
            ["sh", "-c", "echo 'Unable to contact slurm controller (connect failure)' >&2; exit 1"],
            5.0,
            SlurmUnreachableError,
        ),
        (
            ["sh", "-c", "echo 'slurm_update error: Invalid node state specified' >&2; exit 1"],
            5.0,
            SlurmRejectedError,
        ),
    ],
    ids=["not installed", "no answer in time", "controller unreachable", "slurm said no"],
)
def test_a_slurm_command_failure_raises_its_branch(
    args: list[str], timeout_s: float, expected: type[SlurmCommandError]
) -> None:
    with pytest.raises(expected):
        SlurmCli(timeout_s=timeout_s).run(*args)


# --- The task layer retries only the transient ------------------------------------------------


def flaky(error: Exception, failures: int) -> tuple[list[int], Task[[], str]]:
    calls: list[int] = []

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=transient_only, persist_result=False)
    def step() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise error
        return "done"

    return calls, step


def test_a_transient_error_is_retried_by_the_task_layer() -> None:
    calls, step = flaky(TransientError("throttled"), failures=2)
    state = step(return_state=True)
    assert state.is_completed() and len(calls) == 3


@pytest.mark.parametrize(
    "error",
    [PermanentError("refused"), MedicError("unclassified"), RuntimeError("unknown"), ConnectionError("?")],
    ids=["permanent", "unclassified medic error", "unknown error", "a library's connection error"],
)
def test_a_permanent_or_unknown_error_is_not_retried(error: Exception) -> None:
    calls, step = flaky(error, failures=1)
    state = step(return_state=True)
    assert state.is_failed() and len(calls) == 1


def reboot(incident: str) -> Decision:
    return Decision(incident=incident, classification="hardware", action="reboot", rule="r", reason="-")


def test_a_transiently_failed_reboot_is_tried_again_under_its_claim(
    runtime: Runtime, fleet: SimFleet
) -> None:
    fleet.fail_next("gpu-node-1", "reboot", times=1)
    state = act("inc-t", "gpu-node-1", 0, reboot("inc-t"), return_state=True)
    assert state.is_completed()
    assert [a for n, a in fleet.calls if n == "gpu-node-1"].count("reboot") == 2
    row = runtime.store.get_action("inc-t:gpu-node-1:reboot")
    assert row is not None and (row.status, row.attempts) == ("succeeded", 2)


def test_a_refused_reboot_is_not_tried_again(runtime: Runtime, fleet: SimFleet) -> None:
    fleet.fail_next("gpu-node-1", "reboot", times=5, permanent=True)
    state = act("inc-p", "gpu-node-1", 0, reboot("inc-p"), return_state=True)
    assert state.is_failed()
    assert [a for n, a in fleet.calls if n == "gpu-node-1"].count("reboot") == 1
    row = runtime.store.get_action("inc-p:gpu-node-1:reboot")
    assert row is not None and row.status == "failed"


def test_an_unknown_provider_error_is_not_tried_again(
    runtime: Runtime, fleet: SimFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def timed_out(node: str) -> str:
        calls.append(node)
        raise OSError("read timed out: the reboot may or may not have happened")

    monkeypatch.setattr(runtime.backends.provider, "reboot", timed_out)
    state = act("inc-u", "gpu-node-1", 0, reboot("inc-u"), return_state=True)
    assert state.is_failed() and calls == ["gpu-node-1"]
