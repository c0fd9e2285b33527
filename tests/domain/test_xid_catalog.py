"""NVIDIA's XID catalog (medic/data/xid_catalog.csv, medic/xid.py): the data, the mapping to our
actions, XID 154's recovery actions, the default policy reaching every code, and docs/xid.md."""

from __future__ import annotations

from importlib import resources

import pytest
from checkout import REPO_ROOT
from factories import fault_event

from medic import xid
from medic.facts import facts_of
from medic.gpu_state import KernelSxid
from medic.incidents import correlate
from medic.integrations.kernel_log import parse_sxid, parse_xid
from medic.policy import Decision, decide, load_policy
from medic.policy.model import Action, Classification
from medic.xid import ACTIONS, RECOVERY_ACTIONS, RecoveryAction, Resolution

ROOT = REPO_ROOT
FIXTURES = ROOT / "tests" / "fixtures" / "xid"


@pytest.fixture(scope="module")
def loaded():
    return load_policy(ROOT / "policies" / "default.yaml")


def decide_alone(loaded, code: int, **attributes: object) -> Decision:
    [incident] = correlate([fault_event("xid", node="node-a", gpu=0, code=code, **attributes)])
    return decide(loaded.policy, facts_of(incident), loaded.sha256)


# -- the data --------------------------------------------------------------------------------


def test_the_catalog_is_every_code_nvidia_lists() -> None:
    catalog = xid.catalog()
    assert sorted(catalog) == list(range(1, 173))  # 1-172, no gaps, nothing invented
    assert {e.source for e in catalog.values()} == {xid.CATALOG_URL}


def test_the_file_names_its_source() -> None:
    text = resources.files("medic").joinpath(xid.CATALOG_FILE).read_text(encoding="utf-8")
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any(xid.CATALOG_URL in line for line in header)
    assert xid.CATALOG_URL in (FIXTURES / "SOURCES.md").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("code", "name", "bucket", "unused"),
    [
        (
            13,
            "ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY",
            Resolution.RESTART_APP,
            False,
        ),
        (45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", Resolution.WORKFLOW_XID_45, False),
        (46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", Resolution.RESET_GPU, False),
        (48, "ROBUST_CHANNEL_GPU_ECC_DBE", Resolution.WORKFLOW_XID_48, False),
        (61, "PMU_BREAKPOINT", Resolution.CONTACT_SUPPORT, True),
        (74, "NVLINK_ERROR", Resolution.WORKFLOW_NVLINK_ERR, False),
        (79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", Resolution.RESTART_BM, False),
        (110, "SEC_FAULT_ERROR", Resolution.RESET_GPU, False),
        (145, "NVLINK_RLW_ERROR", Resolution.WORKFLOW_NVLINK5_ERR, False),
        (151, "ROBUST_CHANNEL_KEY_ROTATION_ERROR", Resolution.RESTART_VM, False),
        (154, "GPU_RECOVERY_ACTION_CHANGED", Resolution.XID_154, False),
        (159, "ROBUST_CHANNEL_CHI_NON_DATA_ERROR", Resolution.CHECK_UVM, False),
        (162, "PSHC_REENGAGED", Resolution.NONE_LISTED, False),
        (172, "UNCORRECTABLE_SRAM_ERROR", Resolution.NONE_LISTED, False),
    ],
)
def test_catalog_rows(code: int, name: str, bucket: Resolution, unused: bool) -> None:
    entry = xid.lookup(code)
    assert entry is not None
    assert (entry.name, entry.resolution, entry.unused) == (name, bucket, unused)


def test_a_code_the_catalog_does_not_list() -> None:
    assert xid.lookup(185) is None
    assert xid.resolution(185) is Resolution.NOT_IN_CATALOG


def test_every_bucket_has_an_action_of_ours() -> None:
    assert set(ACTIONS) == set(Resolution)
    assert set(RECOVERY_ACTIONS) == set(RecoveryAction)
    for ours in [*ACTIONS.values(), *RECOVERY_ACTIONS.values()]:
        Action(ours.action)
        Classification(ours.classification)


# -- the default policy reaches every code ---------------------------------------------------


@pytest.mark.parametrize("code", sorted(xid.catalog()))
def test_the_default_policy_decides_every_code_as_the_table_says(loaded, code: int) -> None:
    decision = decide_alone(loaded, code)
    assert decision.rule != "default", f"XID {code} reaches no rule"
    assert decision.action == ACTIONS[xid.resolution(code)].action


@pytest.mark.parametrize("action", list(RecoveryAction))
def test_xid_154_follows_the_recovery_action(loaded, action: RecoveryAction) -> None:
    decision = decide_alone(loaded, 154, recovery_action=action.value)
    assert decision.action == RECOVERY_ACTIONS[action].action
    assert decision.rule.startswith("xid-154-")


# -- XID 154 messages -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "action"),
    [
        (
            "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
            RecoveryAction.NODE_REBOOT,
        ),
        ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", RecoveryAction.GPU_RESET),
        ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", RecoveryAction.DRAIN_P2P),
        (
            "GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)",
            RecoveryAction.DRAIN_AND_RESET,
        ),
        ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", RecoveryAction.NONE),
        # drivers that print other texts for the same values
        ("GPU recovery action changed from 0x0 (None) to 0x2 (OS Reboot)", RecoveryAction.NODE_REBOOT),
        ("GPU recovery action changed from 0x0 (None) to 0x1 (PF FLR)", RecoveryAction.GPU_RESET),
        # the text serves where there is no value
        ("Xid 154 GPU recovery action changed from None to Drain and Reset", RecoveryAction.DRAIN_AND_RESET),
        ("GPU recovery action changed from 0x0 (None) to 0x9 (Something New)", RecoveryAction.UNKNOWN),
        ("GPU has fallen off the bus.", RecoveryAction.UNKNOWN),
        (None, RecoveryAction.UNKNOWN),
    ],
)
def test_recovery_action_from_the_message(message: str | None, action: RecoveryAction) -> None:
    assert xid.recovery_action(message) is action


def test_kernel_log_fixture_lines_reach_the_policy(loaded) -> None:
    lines = (FIXTURES / "kernel_log.txt").read_text(encoding="utf-8").splitlines()
    xids = [x for line in lines if (x := parse_xid(line))]
    sxids = [s for line in lines if (s := parse_sxid(line))]
    assert [(x.code, x.gpu_instance, x.compute_instance) for x in xids] == [
        (79, None, None),
        (154, None, None),
        (94, 5, None),
        (13, 3, 1),
        (154, None, None),
    ]
    assert [xid.recovery_action(x.message) for x in xids if x.code == 154] == [
        RecoveryAction.NODE_REBOOT,
        RecoveryAction.GPU_RESET,
    ]
    assert sxids == [
        KernelSxid(
            "nvswitch0",
            "0000:05:00",
            12028,
            "Non-fatal, Link 32 egress non-posted PRIV error (First)",
            False,
            32,
        ),
        KernelSxid("nvswitch3", "0000:c1:00", 24007, "Fatal, Link 30 sourcetrack timeout error", True, 30),
    ]
    reboot = decide_alone(loaded, 154, message=xids[1].message)
    assert (reboot.action, reboot.rule) == (Action.REBOOT, "xid-154-node-reboot")


# -- docs/xid.md -----------------------------------------------------------------------------


def test_the_doc_table_matches_the_catalog() -> None:
    doc = (ROOT / "docs" / "xid.md").read_text(encoding="utf-8")
    assert xid.with_table(doc) == doc, "docs/xid.md is stale: python -m medic.xid --write docs/xid.md"
    for code in (61, 74, 154, 162):
        assert f"| {code} | `{xid.catalog()[code].name}` |" in doc
