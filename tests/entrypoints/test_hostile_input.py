"""Hostile input at every boundary (issue 15): each bad input is answered with a reason, none crashes.

The same inputs go through `medic.intake` (what `ingest` and the server use), through
`medic triage` as a subprocess (the whole command, console script included), and hostile policy
files through the loader and `medic policy check`. Then hypothesis fuzzes the intake and the
loader: the only answers allowed are an event, a `Rejection` and a `PolicyError`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import event_dict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.events import INT64_MAX, INT64_MIN, FaultEvent
from medic.intake import MAX_LINE_BYTES, Rejection, parse_line, read_file, read_lines
from medic.policy import PolicyError, load_policy
from medic.policy.loader import (
    MAX_ALIAS_NODES,
    MAX_DEPTH,
    MAX_INTEGER_DIGITS,
    MAX_POLICY_BYTES,
    decode_policy,
    parse_policy,
)
from medic.whatif.testing import load_tests

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"


def line(event_id: str = "ev-1", kind: str = "xid", **fields: Any) -> str:
    return json.dumps(event_dict(kind, id=event_id) | fields)


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


# Each: (name, the raw line, a fragment the reason must contain).
HOSTILE_LINES = [
    (
        "year-1 with +01:00 (its UTC time is before year 1)",
        line(time="0001-01-01T00:00:00+01:00"),
        "time: 0001-01-01T00:00:00+01:00 is out of range: its UTC time is not representable",
    ),
    ("year 9999 with -01:00", line(time="9999-12-31T23:59:59-01:00"), "time: 9999-12-31T23:59:59-01:00"),
    ("before 1970", line(time="1969-12-31T23:59:59Z"), "must be from 1970-01-01T00:00:00Z to before"),
    ("year 2100", line(time="2100-01-01T00:00:00Z"), "time: 2100-01-01T00:00:00+00:00 is out of range"),
    ("gpu 2**63", line(gpu=2**63), "gpu: integer out of range: must fit in signed 64 bits"),
    ("iteration 2**63 as a string", line(iteration=str(2**63)), "iteration: integer out of range"),
    (
        "attribute 2**63",
        line(attributes={"code": 79, "bus": 2**63}),
        "attributes.bus: integer out of range",
    ),
    (
        "attribute -2**63-1",
        line(attributes={"code": 79, "bus": INT64_MIN - 1}),
        "attributes.bus: integer out of range",
    ),
    (
        "ecc count 2**64 as a string, coerced",
        line(kind="ecc", attributes={"dbe": str(2**64)}),
        "attributes.dbe: integer out of range",
    ),
    ("4,000-digit integer", line(gpu=int("9" * 4000)), "gpu: integer out of range"),
    (
        "5,000-digit integer",
        line(gpu=1).replace('"gpu": 1', '"gpu": ' + "9" * 5000),
        "not JSON: Exceeds the limit",
    ),
    ("lone surrogate in source", line(source="agent\ud800"), "source: not valid UTF-8 (contains a lone"),
    (
        "lone surrogate in an attribute",
        line(attributes={"code": 79, "message": "\udfff"}),
        "attributes.message: not valid UTF-8",
    ),
    (
        "lone surrogate in an attribute key",
        line(attributes={"code": 79, "k\ud800": 1}),
        "attributes key: not valid UTF-8",
    ),
    ("NaN", line(attributes={"code": 79, "x": float("nan")}), "not JSON: NaN is not a JSON number"),
    ("1e999", line(kind="thermal", attributes={}).replace("{}", '{"temperature_c": 1e999}'), "finite"),
    ("2 MB line", line(attributes={"code": 79, "message": "x" * 2_000_000}), "line longer than 65536"),
    ("attributes 33 deep", line(attributes={"code": 79, "x": nested(33)}), "nested deeper than 32"),
    (
        "attributes 10,000 deep",
        line(attributes={"code": 79}).replace("79}", '79, "x": ' + '{"a":' * 10_000 + "1" + "}" * 10_001),
        "not JSON",
    ),
    (
        "10,000-deep JSON",
        line(attributes={"code": 79}).replace('"code": 79', '"x": ' + "[" * 10_000 + "]" * 10_000),
        "not JSON",
    ),
    (
        "1,001 attribute items",
        line(attributes={"code": 79, "x": list(range(1001))}),
        "attributes: more than 1000 keys and items",
    ),
    ("NUL", line(source="a\x00b"), "NUL"),
]


@pytest.mark.parametrize(("raw", "reason"), [h[1:] for h in HOSTILE_LINES], ids=[h[0] for h in HOSTILE_LINES])
def test_hostile_line_is_a_rejection_with_a_reason(raw: str, reason: str) -> None:
    rejection = parse_line(raw, "hostile.jsonl:7")
    assert isinstance(rejection, Rejection), rejection
    assert reason in rejection.reason
    assert str(rejection).startswith("hostile.jsonl:7: ")
    assert len(rejection.raw) <= MAX_LINE_BYTES
    rejection.raw.encode("utf-8")  # the dead letter itself can be stored


def test_limits_are_inclusive_where_documented() -> None:
    edge = line(
        time="1970-01-01T01:00:00+01:00",
        gpu=INT64_MAX,
        attributes={"code": 79, "low": INT64_MIN, "x": nested(31), "fine": "ü✓"},
    )
    event = parse_line(edge, "f:1")
    assert isinstance(event, FaultEvent), event
    assert event.gpu == INT64_MAX
    assert parse_line(line(time="2099-12-31T23:59:59.999999Z"), "f:2") == FaultEvent.model_validate_json(
        line(time="2099-12-31T23:59:59.999999Z")
    )


def test_a_poison_line_between_good_ones_costs_only_itself() -> None:
    poison = [raw for _, raw, _ in HOSTILE_LINES]
    lines = [line("good-0")]
    for number, raw in enumerate(poison, start=1):
        lines += [raw, line(f"good-{number}")]
    intake = read_lines(lines, "batch.jsonl")
    assert [e.id for e in intake.events] == [f"good-{n}" for n in range(len(poison) + 1)]
    assert [r.origin for r in intake.rejected] == [f"batch.jsonl:{2 * n}" for n in range(1, len(poison) + 1)]


def test_a_2gb_style_line_in_a_file_is_never_held_whole(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        handle.write(line("before") + "\n")
        handle.write('{"id": "huge", "attributes": {"message": "' + "x" * 20_000_000 + '"}}\n')
        handle.write(line("after") + "\n")
    tracemalloc.start()
    intake = read_file(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [e.id for e in intake.events] == ["before", "after"]
    (rejection,) = intake.rejected
    assert rejection.origin == f"{path}:2"
    assert rejection.reason == f"line longer than {MAX_LINE_BYTES} bytes"
    assert peak < 5_000_000  # not the 20 MB line


def _medic() -> list[str]:
    script = Path(sys.executable).with_name("medic")
    return (
        [str(script)]
        if script.is_file()
        else [sys.executable, "-c", "from medic.apps.cli.app import main; main()"]
    )


def test_medic_triage_reports_each_bad_line_and_decides_the_rest(tmp_path: Path) -> None:
    good = [
        line("x-1", node="gpu-001", attributes={"code": 79}),
        line("x-2", node="gpu-002", attributes={"code": 79}),
        line("x-3", node="gpu-003", attributes={"code": 79}),
    ]
    poison = [raw for _, raw, _ in HOSTILE_LINES]
    path = tmp_path / "events.jsonl"
    path.write_text(
        "\n".join([good[0], *poison[: len(poison) // 2], good[1], *poison[len(poison) // 2 :], good[2]])
    )
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "MEDIC_POLICY")}
    env["MEDIC_HOME"] = str(tmp_path / "home")
    started = time.perf_counter()
    done = subprocess.run(
        [*_medic(), "triage", str(path), "--json", "--policy", str(DEFAULT_POLICY)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert time.perf_counter() - started < 30
    assert "Traceback" not in done.stderr
    lines = [json.loads(out) for out in done.stdout.splitlines()]
    assert sorted(node for out in lines for node in out["nodes"]) == ["gpu-001", "gpu-002", "gpu-003"]
    bad_numbers = [n for n, text in enumerate(path.read_text().splitlines(), start=1) if text not in good]
    for number in bad_numbers:
        assert f"{path}:{number}: " in done.stderr
    assert done.stderr.count("rejected ") == len(poison)
    assert "is out of range: its UTC time is not representable" in done.stderr


# --- the policy loader ----------------------------------------------------------------------------

RULE = """\
rules:
  - id: x
    description: d
    when: {kinds: [xid]}
    then: {classification: unknown, action: diagnose, diagnose_level: 1}
"""


def billion_laughs() -> str:
    lines = ['lol0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        lines.append(f"lol{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "version: 1\n" + "\n".join(lines) + "\n" + RULE.replace("action: diagnose", "action: *a9")


# Each: (name, the file's bytes, line, column, a fragment of the message).
HOSTILE_POLICIES = [
    (
        "billion laughs",
        billion_laughs().encode(),
        6,
        12,
        f"aliases expand to more than {MAX_ALIAS_NODES} nodes",
    ),
    ("10,000-deep flow", ("rules: " + "[" * 10_000 + "]" * 10_000).encode(), 1, 40, "nested deeper than 32"),
    ("10,000-deep block", ("rules:\n  " + "- " * 10_000 + "x\n").encode(), 2, 65, "nested deeper than 32"),
    ("10,000-deep mapping", ("rules: " + "{a: " * 10_000 + "1" + "}" * 10_000).encode(), 1, 132, "deeper"),
    (
        "binary bytes",
        b"version: 1\nrules:\n  - id: \xff\xfe\x00" + bytes(range(256)),
        3,
        9,
        "not UTF-8 text: byte 0xff",
    ),
    ("control characters", b"version: 1\nrules:\n  - id: a\x07b\n", 3, 10, "control character U+0007"),
    (
        "5,000-digit integer",
        (RULE + "    priority: " + "9" * 5000 + "\n").encode(),
        6,
        15,
        "integer of 5000 digits",
    ),
    (
        "5,000-digit !!int",
        (RULE + "    priority: !!int '" + "9" * 5000 + "'\n").encode(),
        6,
        15,
        "5000 digits",
    ),
    (
        "base-60 integer",
        (RULE + "    priority: 1" + ":59" * 100 + "\n").encode(),
        6,
        15,
        "integer of 201 digits",
    ),
    (
        "recursive alias",
        b"version: 1\nrules: &r [1, *r]\n",
        2,
        15,
        "alias *r refers to a node that contains it",
    ),
    (
        "a 13th month",
        b"version: 1\ndescription: 2025-13-45\n",
        2,
        14,
        "cannot read '2025-13-45' as timestamp",
    ),
    ("over 1 MiB", b"# " + b"x" * MAX_POLICY_BYTES + b"\n", 1, 1, f"larger than {MAX_POLICY_BYTES} bytes"),
    (
        "python object",
        b"version: !!python/object/apply:os.system ['true']\n",
        1,
        10,
        "invalid YAML: could not",
    ),
]


@pytest.mark.parametrize(
    ("raw", "line_no", "column", "message"),
    [h[1:] for h in HOSTILE_POLICIES],
    ids=[h[0] for h in HOSTILE_POLICIES],
)
def test_hostile_policy_is_a_policy_error_at_file_line(
    tmp_path: Path, raw: bytes, line_no: int, column: int, message: str
) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(raw)
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.column) == (str(path), line_no, column), str(problem)
    assert message in problem.message
    assert str(problem).startswith(f"{path}:{line_no}:{column}: ")
    assert elapsed < 1.0
    assert peak < 20_000_000  # bytes: the billion laughs took 2.45 GB


def test_billion_laughs_is_refused_in_under_100_ms(tmp_path: Path) -> None:
    path = tmp_path / "lol.yaml"
    path.write_text(billion_laughs())
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        with pytest.raises(PolicyError):
            load_policy(path)
        best = min(best, time.perf_counter() - started)
    assert best < 0.1


def test_limits_leave_room_for_real_policies(tmp_path: Path) -> None:
    assert load_policy(DEFAULT_POLICY).policy.rules  # aliases (&fatal_xids) and all
    deep = "version: 1\ndescription: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "\n" + RULE
    with pytest.raises(PolicyError) as caught:  # read, then refused by the model, not the loader
        parse_policy(deep, "deep.yaml")
    assert [p.message for p in caught.value.problems] == ["description: Input should be a valid string"]
    assert parse_policy(RULE + f"    priority: {'9' * MAX_INTEGER_DIGITS}\n", "p.yaml").rules[0].priority
    shared = "version: 1\nx: &x [" + ", ".join(["1"] * 999) + "]\ny: [*x, *x, *x]\n"
    with pytest.raises(PolicyError) as caught:  # 3,000 nodes by alias: allowed; `x`, `y` unknown keys
        parse_policy(shared + RULE, "shared.yaml")
    assert all("unknown key" in p.message for p in caught.value.problems)


def test_policy_tests_files_get_the_same_limits(tmp_path: Path) -> None:
    path = tmp_path / "p.tests.yaml"
    path.write_text(billion_laughs().replace("version: 1\n", "") + "tests: []\n")
    with pytest.raises(PolicyError, match="aliases expand to more than"):
        load_tests(path)


@pytest.mark.parametrize(
    ("raw", "line_no", "column", "message"),
    [h[1:] for h in HOSTILE_POLICIES[:5]],
    ids=[h[0] for h in HOSTILE_POLICIES[:5]],
)
def test_medic_policy_check_prints_the_problem_and_exits_1(
    tmp_path: Path, raw: bytes, line_no: int, column: int, message: str
) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(raw)
    result = CliRunner().invoke(app, ["policy", "check", str(path), str(DEFAULT_POLICY)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"{path}:{line_no}:{column}: " in result.stderr
    assert message in result.stderr
    assert f"{DEFAULT_POLICY}: ok" in result.stdout  # every file is still checked


# --- fuzzing ------------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["0001-01-01T00:00:00+01:00", "2025-03-01T12:00:00Z", "9999-12-31T23:59:59-23:59"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
EVENT_KEYS = list(FaultEvent.model_fields)


@st.composite
def event_like(draw: st.DrawFn) -> str:
    """Mostly valid events with some fields replaced by anything; then maybe mangled as text."""
    base = event_dict(
        draw(st.sampled_from(["xid", "ecc", "thermal", "gpu_missing", "diagnostic", "nan_loss"]))
    )
    for key in draw(st.lists(st.sampled_from([*EVENT_KEYS, "extra"]), max_size=3)):
        base[key] = draw(JSON_VALUES)
    text = json.dumps(base, allow_nan=True, ensure_ascii=draw(st.booleans()))
    cut = draw(st.integers(min_value=0, max_value=len(text)))
    return draw(
        st.sampled_from(
            [
                text,
                text[:cut],
                text[:cut] + draw(st.text(max_size=8)) + text[cut:],
                text.replace('"', "", 1),
            ]
        )
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(event_like(), st.text(max_size=300), JSON_VALUES.map(json.dumps)))
def test_fuzz_intake_answers_every_line(raw: str) -> None:
    parsed = parse_line(raw, "fuzz.jsonl:1")
    assert isinstance(parsed, FaultEvent | Rejection)
    if isinstance(parsed, Rejection):
        assert parsed.reason
        parsed.raw.encode("utf-8")
    else:  # an accepted event is one the store can hold, and reads back the same
        assert FaultEvent.model_validate_json(parsed.model_dump_json()) == parsed
    intake = read_lines([raw, line("after")], "fuzz.jsonl")
    assert len(intake.events) + len(intake.rejected) + len(intake.duplicates) >= 1
    assert intake.events[-1].id == "after" or "after" in intake.duplicates


YAML_PIECES = [
    "version: 1\n", "rules:\n", "  - id: x\n", "    when: {kinds: [xid]}\n", "    then: {action: *a}\n",
    "a", "b: ", ": ", "- ", "\n", "  ", "[", "]", "{", "}", ", ", "&a ", "*a", "*b", "&b ", "<<: ", "? ",
    "!!int ", "!!binary ", "!!python/name:os.system ", "!!timestamp ", "!!float ", "'", '"', "#", "|", ">", "\t",
    "---\n", "...\n", "%YAML 1.1\n", "%TAG ! tag:x,2000:\n", "9" * 40, "0x" + "f" * 40, "1:59:59", "2025-13-45",
    "2025-03-01T12:00:00Z", "1e999", ".nan", "~", "null", "\x00", "\x07", "\ud800", "\ufeff", "é", "\\u0000",
]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.lists(st.sampled_from(YAML_PIECES), max_size=40).map("".join), st.text(max_size=200)))
def test_fuzz_policy_loader_answers_every_text(text: str) -> None:
    try:
        parse_policy(text, "fuzz.yaml")
    except PolicyError as error:
        assert error.problems
        assert all(p.file == "fuzz.yaml" and p.line >= 1 and p.column >= 1 for p in error.problems)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.binary(max_size=300)
    | st.lists(st.sampled_from(YAML_PIECES), max_size=30).map(
        lambda p: "".join(p).encode("utf-8", "surrogatepass")
    )
)
def test_fuzz_policy_loader_answers_every_file(raw: bytes) -> None:
    try:
        parse_policy(decode_policy(raw, "fuzz.yaml"), "fuzz.yaml")
    except PolicyError as error:
        assert error.problems
