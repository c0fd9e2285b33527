"""Loading policy files: every mistake is reported as file:line:column at the offending line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from checkout import REPO_ROOT

from medic.policy import PolicyError, load_policy
from medic.policy.loader import parse_policy

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"

GOOD = """\
version: 1
rules:
  - id: first
    description: A fine rule
    when:
      kinds: [nccl_timeout]
    then:
      classification: unknown
      action: diagnose
      diagnose_level: 1
"""


def problems_of(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    assert str(caught.value) == "\n".join(map(str, caught.value.problems))
    return [str(p).removeprefix(f"{path}:") for p in caught.value.problems]


def line_of(text: str, needle: str) -> int:
    """1-based line of the last line containing `needle`."""
    return max(n for n, line in enumerate(text.splitlines(), start=1) if needle in line)


def test_good_policy_parses():
    policy = parse_policy(GOOD, "good.yaml")
    assert [r.id for r in policy.rules] == ["first"]


def test_unknown_key_in_when(tmp_path):
    text = GOOD.replace("      kinds: [nccl_timeout]\n", "      kinds: [nccl_timeout]\n      xids: [79]\n")
    (problem,) = problems_of(text, tmp_path)
    assert problem == f"{line_of(text, 'xids')}:7: rules.0.when.xids: unknown key"


def test_unknown_top_level_key(tmp_path):
    text = "rule:\n  - id: x\n" + GOOD.removeprefix("version: 1\n")
    problems = problems_of(text, tmp_path)
    assert "1:1: rule: unknown key" in problems


def test_bad_action_value(tmp_path):
    text = GOOD.replace("action: diagnose\n      diagnose_level: 1", "action: rebooot")
    (problem,) = problems_of(text, tmp_path)
    line, column, message = problem.split(":", 2)
    assert (int(line), int(column)) == (line_of(text, "rebooot"), 15)
    assert "rules.0.then.action: expected" in message
    assert "'reboot'" in message


def test_bad_event_kind_points_at_the_list_item(tmp_path):
    text = GOOD.replace("kinds: [nccl_timeout]", "kinds: [xid, ncl_timeout]")
    (problem,) = problems_of(text, tmp_path)
    assert problem.startswith(f"{line_of(text, 'ncl_timeout')}:20: rules.0.when.kinds.1: expected")


def test_diagnose_without_level(tmp_path):
    text = GOOD.replace("      diagnose_level: 1\n", "")
    (problem,) = problems_of(text, tmp_path)
    line = int(problem.split(":")[0])
    # The `then` block (its first line), which names the rule's missing diagnose_level.
    assert line_of(text, "then:") < line <= line_of(text, "action: diagnose")
    assert "rules.0.then: action diagnose needs diagnose_level" in problem


def test_diagnose_level_out_of_range(tmp_path):
    text = GOOD.replace("diagnose_level: 1", "diagnose_level: 5")
    (problem,) = problems_of(text, tmp_path)
    assert "diagnose_level must be between 1 and 4" in problem


def test_invalid_yaml(tmp_path):
    text = GOOD.replace("kinds: [nccl_timeout]", "kinds: [nccl_timeout")
    (problem,) = problems_of(text, tmp_path)
    line = int(problem.split(":")[0])
    assert line_of(text, "kinds:") <= line <= line_of(text, "then:")
    assert "invalid YAML" in problem


def test_tab_indentation_is_invalid_yaml(tmp_path):
    text = GOOD.replace("      kinds", "\tkinds")
    (problem,) = problems_of(text, tmp_path)
    assert problem.startswith(f"{line_of(text, 'kinds')}:")
    assert "invalid YAML" in problem


def test_duplicate_rule_ids_point_at_the_second(tmp_path):
    text = GOOD + GOOD.split("rules:\n", 1)[1]
    (problem,) = problems_of(text, tmp_path)
    assert problem == f"{line_of(text, 'id: first')}:9: rules.1.id: rule id 'first' is used twice"


def test_empty_when(tmp_path):
    text = GOOD.replace("    when:\n      kinds: [nccl_timeout]\n", "    when: {}\n")
    (problem,) = problems_of(text, tmp_path)
    assert problem.startswith(f"{line_of(text, 'when:')}:")
    assert "rules.0.when: rule first: `when` needs at least one condition" in problem


def test_when_without_a_value(tmp_path):
    text = GOOD.replace("    when:\n      kinds: [nccl_timeout]\n", "    when:\n")
    (problem,) = problems_of(text, tmp_path)
    assert problem.startswith(f"{line_of(text, 'when:')}:")
    assert "rules.0.when" in problem


def test_several_problems_are_all_reported(tmp_path):
    text = GOOD.replace("classification: unknown", "classification: softwar")
    text = text.replace("kinds: [nccl_timeout]", "kinds: [nccl_timeout]\n      oops: 1")
    problems = problems_of(text, tmp_path)
    assert len(problems) == 2
    assert any(p.startswith(f"{line_of(text, 'oops')}:7:") for p in problems)
    assert any(p.startswith(f"{line_of(text, 'softwar')}:23:") for p in problems)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "- a list\n", "just a string\n"])
def test_not_a_mapping(tmp_path, text):
    (problem,) = problems_of(text, tmp_path)
    assert problem == "1:1: expected a mapping with `rules:`"


def test_wrong_version(tmp_path):
    (problem,) = problems_of(GOOD.replace("version: 1", "version: 2"), tmp_path)
    assert problem == "1:10: version: expected 1, got 2"


def test_missing_file(tmp_path):
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "nope.yaml")


def test_default_policy_loads_and_is_hashed_from_its_bytes():
    loaded = load_policy(DEFAULT_POLICY)
    assert loaded.sha256 == hashlib.sha256(DEFAULT_POLICY.read_bytes()).hexdigest()
    assert loaded.path == str(DEFAULT_POLICY)
    assert loaded.policy.version == 1
    assert len(loaded.policy.rules) >= 10
    assert len({r.id for r in loaded.policy.rules}) == len(loaded.policy.rules)


def test_sha256_changes_with_any_byte(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    before = load_policy(path).sha256
    path.write_text(GOOD + "# a comment\n")
    after = load_policy(path).sha256
    assert before != after
    assert after == hashlib.sha256(path.read_bytes()).hexdigest()


# --- the loader's limits (docs/policy.md#limits-of-the-loader; tests/entrypoints/test_hostile_input.py has the attacks)


def test_aliases_a_policy_needs_are_still_read(tmp_path):
    text = GOOD.replace("kinds: [nccl_timeout]", "kinds: &k [nccl_timeout]") + "description: *k\n"
    (problem,) = problems_of(text, tmp_path)
    assert problem.endswith("description: Input should be a valid string")  # read fine, then typed


def test_undefined_alias_is_still_invalid_yaml(tmp_path):
    (problem,) = problems_of(GOOD.replace("[nccl_timeout]", "*nowhere"), tmp_path)
    assert problem == "6:14: invalid YAML: found undefined alias 'nowhere'"


def test_non_utf8_byte_is_placed_at_its_line_and_column(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(GOOD.replace("A fine rule", "Caf\u00e9 rule").encode("latin-1"))
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    (problem,) = caught.value.problems
    assert str(problem) == f"{path}:4:21: not UTF-8 text: byte 0xe9 cannot be read (a binary file?)"


def test_integer_of_30_digits_is_read_and_31_is_refused(tmp_path):
    rule = GOOD + "    priority: {}\n"
    assert parse_policy(rule.format("1" * 30), "p.yaml").rules[0].priority == int("1" * 30)
    (problem,) = problems_of(rule.format("1" * 31), tmp_path)
    assert problem == "11:15: integer of 31 digits; at most 30 (the limit for a policy file)"


def test_quoted_long_numbers_are_strings_not_integers(tmp_path):
    assert parse_policy(GOOD.replace("A fine rule", "'" + "9" * 5000 + "'"), "p.yaml").rules[0].description


def test_a_window_beyond_a_year_is_refused_at_its_line(tmp_path):
    # Accepted, it would overflow the datetime arithmetic when the rule is evaluated.
    text = GOOD.replace(
        "      kinds: [nccl_timeout]\n",
        "      kinds: [nccl_timeout]\n      count:\n        - kinds: [xid]\n"
        "          at_least: 2\n          within_minutes: 99999999999999999999999\n",
    )
    (problem,) = problems_of(text, tmp_path)
    assert problem.startswith(f"{line_of(text, 'within_minutes')}:")
    assert "rules.0.when.count.0.within_minutes: Input should be less than or equal to 525600" in problem


def test_an_approver_by_display_name_is_refused_at_its_line(tmp_path):
    # Anyone can take a display name in Slack; only an id or an email names one person.
    text = GOOD.replace(
        "rules:\n",
        "approvals:\n  approvers:\n    - U024BE7LH\n    - alice\n    - bob@example.com\nrules:\n",
        1,
    )
    (problem,) = problems_of(text, tmp_path)
    assert problem.startswith(f"{line_of(text, '- alice')}:7: approvals.approvers.1: 'alice' is neither")
    assert "Slack user id" in problem and "email" in problem


def test_approvers_by_slack_id_or_email_load():
    text = GOOD.replace(
        "rules:\n", "approvals:\n  approvers: [U024BE7LH, W0ENTERPRISE1, ops@example.com]\nrules:\n"
    )
    approvals = parse_policy(text, "good.yaml").approvals
    assert approvals.approvers == ["U024BE7LH", "W0ENTERPRISE1", "ops@example.com"]


def test_the_default_policy_asks_before_every_replace():
    approvals = load_policy(DEFAULT_POLICY).policy.approvals
    assert approvals.required_for == ["replace"]


def test_policy_check_refuses_an_approver_by_name_with_its_place(tmp_path):
    from typer.testing import CliRunner

    from medic.apps.cli.app import app

    path = tmp_path / "site.yaml"
    path.write_text(GOOD.replace("rules:\n", "approvals:\n  approvers: [U024BE7LH, alice]\nrules:\n", 1))
    result = CliRunner().invoke(app, ["policy", "check", str(path)])
    assert result.exit_code == 1
    assert f"{path}:3:26: approvals.approvers.1: 'alice' is neither a Slack user id" in result.output
