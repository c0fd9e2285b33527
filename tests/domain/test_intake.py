"""Reading raw lines into events: rejections (dead letters), duplicates, never a crash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from factories import event_dict
from hypothesis import given, settings
from hypothesis import strategies as st

from medic.events import EventKind, FaultEvent
from medic.intake import (
    DEAD_LETTER_SAMPLE,
    MAX_LINE_BYTES,
    Intake,
    Rejection,
    RejectionSample,
    iter_jsonl,
    parse_line,
    read_file,
    read_lines,
    reason_class,
    rejection_source,
)


def line(event_id: str = "ev-1", kind: str = "xid", **fields: Any) -> str:
    """xid 79 on gpu-017 at T0; `fields` replace top-level keys as written, valid or not."""
    return json.dumps(event_dict(kind, id=event_id) | fields)


def write(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- parse_line -----------------------------------------------------------------------------


def test_parse_line_accepts_a_valid_event() -> None:
    event = parse_line(line(), "events.jsonl:1")
    assert isinstance(event, FaultEvent)
    assert (event.id, event.kind, event.node) == ("ev-1", EventKind.XID, "gpu-017")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("not json", "not JSON: Expecting value at column 1"),
        ('{"id": "ev-1",', "not JSON: "),
        ("{'id': 'ev-1'}", "not JSON: "),
        ("[1, 2, 3]", "expected a JSON object, got list"),
        ('"an event"', "expected a JSON object, got str"),
        ("42", "expected a JSON object, got int"),
        ("null", "expected a JSON object, got NoneType"),
        ("[" * 5000, "not JSON: "),  # deeper than json's recursion limit
        ('{"id": ' + "9" * 5000 + "}", "not JSON: "),  # integer past Python's digit limit
    ],
)
def test_malformed_lines_become_rejections(raw: str, expected: str) -> None:
    rejection = parse_line(raw, "events.jsonl:7")
    assert isinstance(rejection, Rejection)
    assert rejection.origin == "events.jsonl:7"
    assert rejection.raw == raw
    assert rejection.reason.startswith(expected), rejection.reason


def test_rejection_names_the_line_and_the_field() -> None:
    rejection = parse_line(line(attributes={}), "events.jsonl:12")
    assert isinstance(rejection, Rejection)
    assert str(rejection) == "events.jsonl:12: attributes.code: Field required"


def test_over_long_line_is_rejected_and_truncated() -> None:
    raw = line(attributes={"code": 79, "message": "x" * MAX_LINE_BYTES})
    rejection = parse_line(raw, "big.jsonl:3")
    assert isinstance(rejection, Rejection)
    assert rejection.reason == f"line longer than {MAX_LINE_BYTES} bytes"
    assert rejection.raw == raw[:1000]


def test_line_length_limit_is_in_bytes_and_inclusive() -> None:
    def padded(size: int, pad: str) -> str:
        text = line(attributes={"code": 79, "message": ""})
        missing = size - len(text.encode())
        return line(attributes={"code": 79, "message": pad * (missing // len(pad.encode()))})

    at_limit = padded(MAX_LINE_BYTES, "x")
    assert len(at_limit.encode()) == MAX_LINE_BYTES
    assert isinstance(parse_line(at_limit, "f:1"), FaultEvent)
    assert isinstance(parse_line(at_limit[:-2] + 'x"}}', "f:1"), Rejection)  # one byte more

    # Fewer characters than the limit, but more bytes: still too long.
    escaped = line(attributes={"code": 79, "message": "é" * (MAX_LINE_BYTES // 2)})
    wide = json.dumps(json.loads(escaped), ensure_ascii=False)
    assert len(wide) < MAX_LINE_BYTES < len(wide.encode())
    rejection = parse_line(wide, "f:1")
    assert isinstance(rejection, Rejection)
    assert rejection.reason.startswith("line longer than")


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_parse_line_never_raises(raw: str) -> None:
    assert isinstance(parse_line(raw, "fuzz:1"), FaultEvent | Rejection)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["id", "time", "source", "kind", "node", "gpu", "attributes", "extra"]),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
            lambda inner: (
                st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
            ),
            max_leaves=10,
        ),
    )
)
def test_parse_line_never_raises_on_json_objects(data: dict[str, Any]) -> None:
    assert isinstance(parse_line(json.dumps(data), "fuzz:1"), FaultEvent | Rejection)


# --- read_lines / read_file -----------------------------------------------------------------


def test_read_file_keeps_good_events_and_every_bad_line(tmp_path: Path) -> None:
    path = write(
        tmp_path / "events.jsonl",
        line("ev-1"),
        "",
        "   ",
        "not json",
        line("ev-2", time="2025-03-01T12:00:00"),
        "[1, 2]",
        line("ev-3", kind="gpu_missing", attributes={"expected": 8, "found": 8}),
        line("ev-4", kind="diagnostic", attributes={"level": 5, "result": "fail"}),
        line("ev-5", kind="quantum_flux"),
        line("ev-6", colour="red"),
        line("ev-7", kind="job_crash", attributes={"exit_code": 137}),
    )
    intake = read_file(path)
    assert [e.id for e in intake.events] == ["ev-1", "ev-7"]
    assert intake.duplicates == []
    assert [str(r) for r in intake.rejected] == [
        f"{path}:4: not JSON: Expecting value at column 1",
        f"{path}:5: time: Input should have timezone info",
        f"{path}:6: expected a JSON object, got list",
        f"{path}:7: attributes: found (8) must be less than expected (8)",
        f"{path}:8: attributes.level: Input should be less than or equal to 4",
        f"{path}:9: kind: " + intake.rejected[5].reason.removeprefix("kind: "),
        f"{path}:10: colour: Extra inputs are not permitted",
    ]
    assert intake.rejected[5].reason.startswith("kind: Input should be 'xid'")
    # The raw line is kept as read, so it can be fixed and replayed.
    assert intake.rejected[0].raw == "not json"
    assert json.loads(intake.rejected[1].raw)["id"] == "ev-2"


def test_blank_lines_are_skipped_but_counted(tmp_path: Path) -> None:
    path = write(tmp_path / "e.jsonl", "", "", line("ev-1"), "", "oops")
    intake = read_file(path)
    assert [e.id for e in intake.events] == ["ev-1"]
    assert [r.origin for r in intake.rejected] == [f"{path}:5"]


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert read_file(path) == Intake()


def test_over_long_line_in_a_file_does_not_stop_the_rest(tmp_path: Path) -> None:
    huge = line("big", attributes={"code": 79, "message": "x" * (2 * MAX_LINE_BYTES)})
    path = write(tmp_path / "e.jsonl", line("ev-1"), huge, line("ev-2"))
    intake = read_file(path)
    assert [e.id for e in intake.events] == ["ev-1", "ev-2"]
    assert [str(r) for r in intake.rejected] == [f"{path}:2: line longer than {MAX_LINE_BYTES} bytes"]
    assert len(intake.rejected[0].raw) == 1000


def test_over_long_lines_keep_the_line_numbers_of_the_rest(tmp_path: Path) -> None:
    # A line read in pieces is still one line: the numbers after it are the file's.
    path = tmp_path / "e.jsonl"
    path.write_text(
        "x" * (3 * MAX_LINE_BYTES)
        + "\n"
        + line("ev-1")
        + "\r\n"
        + "y" * (MAX_LINE_BYTES + 1)
        + "\r"
        + line("ev-2")
    )
    intake = read_file(path)
    assert [e.id for e in intake.events] == ["ev-1", "ev-2"]
    assert [r.origin for r in intake.rejected] == [f"{path}:1", f"{path}:3"]
    assert [len(r.raw) for r in intake.rejected] == [1000, 1000]


def test_a_line_of_exactly_the_limit_is_read_whole(tmp_path: Path) -> None:
    short = line("ev-1", source="s" * 10)
    exact = short.replace('"ssssssssss"', '"' + "s" * (10 + MAX_LINE_BYTES - len(short)) + '"')
    assert len(exact) == MAX_LINE_BYTES
    path = write(tmp_path / "e.jsonl", exact, line("ev-2"))
    intake = read_file(path)
    assert intake.rejected[0].reason == "source: String should have at most 200 characters"  # parsed, not cut
    assert [e.id for e in intake.events] == ["ev-2"]


def test_a_lone_surrogate_in_the_raw_text_is_rejected_and_the_dead_letter_is_storable() -> None:
    rejection = parse_line(line(source="agent").replace("agent", "agent\udc80"), "f:1")
    assert isinstance(rejection, Rejection)
    assert rejection.reason == "not valid UTF-8 (contains a lone surrogate)"
    assert "agent\ufffd" in rejection.raw


def test_parse_line_turns_an_unexpected_error_into_a_rejection(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any, **__: Any) -> Any:
        raise OverflowError("date value out of range")

    monkeypatch.setattr(FaultEvent, "model_validate", boom)
    rejection = parse_line(line(), "f:9")
    assert isinstance(rejection, Rejection)
    assert str(rejection) == "f:9: cannot be read: OverflowError: date value out of range"


def test_invalid_utf8_and_crlf_do_not_break_a_file(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    path.write_bytes(
        line("ev-1").encode()
        + b"\r\n"
        + b'{"id": "\xff\xfe"}\r\n'
        + b"\xc3\x28 garbage\r\n"
        + line("ev-2").encode()
    )
    intake = read_file(path)
    assert [e.id for e in intake.events] == ["ev-1", "ev-2"]
    assert [r.origin for r in intake.rejected] == [f"{path}:2", f"{path}:3"]
    assert "\ufffd" in intake.rejected[0].raw


def test_whitespace_around_a_line_is_ignored() -> None:
    intake = read_lines(["  " + line() + "  \n"], "stdin")
    assert [e.id for e in intake.events] == ["ev-1"]


def test_duplicates_by_id_are_dropped_and_reported(tmp_path: Path) -> None:
    path = write(
        tmp_path / "e.jsonl",
        line("ev-1"),
        line("ev-2"),
        line("ev-1", node="gpu-099"),  # same id, different content: still a repeat
        line("ev-1"),
    )
    intake = read_file(path)
    assert [e.id for e in intake.events] == ["ev-1", "ev-2"]
    assert intake.events[0].node == "gpu-017"  # the first one wins
    assert intake.duplicates == ["ev-1", "ev-1"]
    assert intake.rejected == []


def test_ids_seen_before_are_duplicates_and_seen_is_updated(tmp_path: Path) -> None:
    seen = {"ev-1"}
    first = read_file(write(tmp_path / "a.jsonl", line("ev-1"), line("ev-2")), seen)
    assert [e.id for e in first.events] == ["ev-2"]
    assert first.duplicates == ["ev-1"]
    assert seen == {"ev-1", "ev-2"}
    # Re-ingesting the same file with the same memory accepts nothing new.
    again = read_file(tmp_path / "a.jsonl", seen)
    assert again.events == []
    assert again.duplicates == ["ev-1", "ev-2"]


def test_without_seen_each_read_starts_fresh(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", line("ev-1"))
    assert [e.id for e in read_file(path).events] == ["ev-1"]
    assert [e.id for e in read_file(path).events] == ["ev-1"]


def test_a_rejected_line_does_not_claim_its_id() -> None:
    intake = read_lines([line("ev-1", attributes={}), line("ev-1")], "fix.jsonl")
    assert [e.id for e in intake.events] == ["ev-1"]
    assert [r.origin for r in intake.rejected] == ["fix.jsonl:1"]
    assert intake.duplicates == []


def test_read_lines_accepts_any_iterable_and_names_origins() -> None:
    intake = read_lines(iter(["bad", line("ev-1")]), "kafka/topic-3")
    assert [r.origin for r in intake.rejected] == ["kafka/topic-3:1"]
    assert [e.id for e in intake.events] == ["ev-1"]


def test_jsonl_round_trip(tmp_path: Path) -> None:
    source = write(
        tmp_path / "in.jsonl",
        line("ev-1", gpu=3, time="2025-03-01T13:00:00+01:00"),
        line("ev-2", kind="thermal", attributes={"temperature_c": 91.5}),
    )
    events = read_file(source).events
    written = list(iter_jsonl(events))
    assert all("null" not in text for text in written)  # unset fields are left out
    copy = write(tmp_path / "out.jsonl", *written)
    assert read_file(copy).events == events


# --- the dead letter's sample of a flood ------------------------------------------------------


def test_a_sample_keeps_the_first_rejections_and_counts_every_one() -> None:
    flood = [parse_line(f"junk {n}", f"http:10.0.0.7:{n}") for n in range(1, 251)]
    flood += [
        parse_line(line(attributes={}), "http:10.0.0.7:251"),
        parse_line("[1]", "sentry:10.0.0.7:error"),
    ]
    rejections = [r for r in flood if isinstance(r, Rejection)]
    sample = RejectionSample.of(rejections)
    assert sample.kept == rejections[:DEAD_LETTER_SAMPLE]
    assert len(sample) == sample.total == 252
    assert sample.counts == {
        ("http:10.0.0.7", "not JSON"): 250,
        ("http:10.0.0.7", "attributes"): 1,
        ("sentry:10.0.0.7:error", "not an object"): 1,
    }
    assert not RejectionSample()


@pytest.mark.parametrize(
    ("origin", "source"),
    [
        ("events.jsonl:12", "events.jsonl"),
        ("http:10.0.0.7:[3]", "http:10.0.0.7"),
        ("http:::1:4", "http:::1"),  # IPv6
        ("sentry:10.0.0.7:event_alert", "sentry:10.0.0.7:event_alert"),  # one item: no position
        ("webhook", "webhook"),
    ],
)
def test_the_source_of_a_rejection_is_its_origin_without_the_position(origin: str, source: str) -> None:
    assert rejection_source(origin) == source


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not an object"),
        (line(attributes={"code": 79, "message": "x" * MAX_LINE_BYTES}), "too long"),
        (line(source="a\x00b"), "NUL"),
        (line(source="agent").replace("agent", "agent\udc80"), "not UTF-8"),
        (line(source="agent\ud800"), "source"),  # an escaped surrogate: the field says it
        (line(time="1969-12-31T23:59:59Z"), "time"),
        (line(attributes={}), "attributes"),
        (line(colour="red"), "unknown field"),
        (line(**{"colour-" + "x" * 100: 1}), "unknown field"),
    ],
)
def test_reason_classes_name_the_failure_in_a_few_words(raw: str, expected: str) -> None:
    rejection = parse_line(raw, "f:1")
    assert isinstance(rejection, Rejection)
    assert reason_class(rejection.reason) == expected


REASON_CLASSES = {"too long", "not JSON", "not an object", "NUL", "not UTF-8", "unreadable", "unknown field"}


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_reason_classes_are_few_whatever_the_reason(reason: str) -> None:
    # Counters are kept per class: a flood inventing keys or messages must not invent classes.
    assert reason_class(reason) in REASON_CLASSES | set(FaultEvent.model_fields) | {"other"}
