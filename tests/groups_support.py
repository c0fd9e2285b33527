"""The shipped policy with node groups (decision 0017), for the tests of `medic triage` and `medic
policy replay`: one group in observe mode with a rule of its own, one remediating under a limit of
its own, and one chosen by a feature as well as by name, which a file of events and the store do not
hold: its nodes' group cannot be told."""

from __future__ import annotations

from pathlib import Path

from checkout import REPO_ROOT

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"

WATCH = """
groups:
  - name: watch
    select: {hostlist: ["gpu-node-[1-2]"]}
    mode: observe
    rules:
      - id: watch-drain-first
        description: XID 79 on a watched node drains it first
        override: true
        when: {xid: [79]}
        then: {classification: hardware, action: drain}
"""
GROUPS = (
    WATCH
    + """\
  - name: fix
    select: {hostlist: ["gpu-node-[3-4]"]}
    mode: remediate
    guardrails: {max_destructive_per_hour: 1}
  - name: racks
    select: {names: ["gpu-node-[56]"], features: [nvl72]}
    mode: contain
"""
)


def grouped_text(groups: str = GROUPS) -> str:
    """The default policy's text with these groups."""
    return DEFAULT_POLICY.read_text(encoding="utf-8") + groups


def write_grouped(path: Path, groups: str = GROUPS) -> Path:
    path.write_text(grouped_text(groups), encoding="utf-8")
    return path
