"""Loading a policy file: YAML → validated `Policy`, with errors that point at file:line:column."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from pydantic import BaseModel, ValidationError

from medic.errors import PermanentError
from medic.policy.model import DuplicateRuleId, Located, Policy

M = TypeVar("M", bound=BaseModel)

# The loader's limits (docs/policy.md#limits). A policy is a page of rules: these are far above
# any real one (the shipped policy: 17 KB, 7 levels, 3 aliases) and far below what costs memory
# or time. Each is checked as the YAML is read, so a hostile file stops at the first excess.
MAX_POLICY_BYTES = 1024 * 1024
MAX_DEPTH = 32  # nested mappings and lists
MAX_ALIASES = 100  # `*name` references
MAX_ALIAS_NODES = 10_000  # nodes that aliases stand for, once expanded ("billion laughs")
MAX_INTEGER_DIGITS = 30  # an integer literal; Python refuses to read past 4300 digits anyway

_INT_TAG = "tag:yaml.org,2002:int"
_INTEGER = next(
    regexp for tag, regexp in yaml.SafeLoader.yaml_implicit_resolvers["1"] if tag == _INT_TAG
)  # the YAML 1.1 integer forms the safe loader reads: 12, 0x1f, 0o17, 1_000, 1:30 (base 60)


class _LimitError(yaml.MarkedYAMLError):
    """A limit exceeded, at the place in the file where it was."""


class _LimitedLoader(yaml.SafeLoader):
    """The safe loader, checking every limit on each event before it is composed, and naming the
    node that cannot be constructed (a 13th month, an over-long integer) instead of raising."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._open: list[list[Any]] = []  # per open collection: [anchor, expanded node count]
        self._sizes: dict[str, int] = {}  # anchor → expanded node count
        self._aliases = 0
        self._expanded = 0

    def get_event(self) -> yaml.Event:
        event = super().get_event()
        if isinstance(event, yaml.CollectionStartEvent):
            if len(self._open) >= MAX_DEPTH:
                raise _limit(event, f"nested deeper than {MAX_DEPTH} levels")
            self._open.append([event.anchor, 1])
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, size = self._open.pop()
            self._done(anchor, size)
        elif isinstance(event, yaml.ScalarEvent):
            if (event.tag == _INT_TAG or (event.tag is None and event.style is None)) and _INTEGER.match(
                event.value
            ):
                digits = sum(c.isalnum() for c in event.value)
                if digits > MAX_INTEGER_DIGITS:
                    raise _limit(event, f"integer of {digits} digits; at most {MAX_INTEGER_DIGITS}")
            self._done(event.anchor, 1)
        elif isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _limit(event, f"more than {MAX_ALIASES} aliases")
            if any(anchor == event.anchor for anchor, _ in self._open):
                raise _limit(event, f"alias *{event.anchor} refers to a node that contains it", limit=False)
            size = self._sizes.get(event.anchor or "", 0)  # an undefined one: the composer says so
            self._expanded += size
            if self._expanded > MAX_ALIAS_NODES:
                raise _limit(event, f"aliases expand to more than {MAX_ALIAS_NODES} nodes")
            self._done(None, size)
        return event

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:  # PyYAML names it so
        # Caught here too, while scanning: the scanner looks ahead over `[[[[...` in quadratic time.
        if self.flow_level >= MAX_DEPTH:
            mark = self.get_mark()
            raise _LimitError(
                None, None, f"nested deeper than {MAX_DEPTH} levels (the limit for a policy file)", mark
            )
        super().fetch_flow_collection_start(TokenClass)

    def _done(self, anchor: str | None, size: int) -> None:
        if anchor is not None:
            self._sizes[anchor] = size
        if self._open:
            self._open[-1][1] += size

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as error:  # PyYAML's constructors raise anything: `!!int ''` is an IndexError
            shown = f" {node.value[:40]!r}" if isinstance(node, yaml.ScalarNode) else ""
            raise _LimitError(
                None,
                None,
                f"cannot read{shown} as {node.tag.rsplit(':', 1)[-1]}: {error}",
                cast(yaml.Mark, node.start_mark),  # the pure-Python loader's Mark
            ) from None


def _limit(event: yaml.Event, problem: str, limit: bool = True) -> _LimitError:
    mark = cast(yaml.Mark, event.start_mark)  # the pure-Python loader's Mark
    return _LimitError(None, None, f"{problem} (the limit for a policy file)" if limit else problem, mark)


def _position(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of the character at `index`."""
    before = text[:index]
    return before.count("\n") + 1, index - (before.rfind("\n") + 1) + 1


def decode_policy(raw: bytes, name: str) -> str:
    """Policy bytes → text: over the size limit, or not UTF-8, is a PolicyError at file:line:column."""
    if len(raw) > MAX_POLICY_BYTES:
        raise PolicyError([PolicyProblem(name, 1, 1, f"larger than {MAX_POLICY_BYTES} bytes")])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        before = raw[: error.start].decode("utf-8")  # valid up to the first bad byte
        line, column = _position(before, len(before))
        problem = f"not UTF-8 text: byte 0x{raw[error.start]:02x} cannot be read (a binary file?)"
        raise PolicyError([PolicyProblem(name, line, column, problem)]) from None


def _load(text: str, name: str) -> tuple[yaml.Node | None, Any]:
    """YAML text → (its node tree, its data), within the limits; PolicyError otherwise."""
    if len(text) > MAX_POLICY_BYTES or len(text.encode("utf-8", "replace")) > MAX_POLICY_BYTES:
        raise PolicyError([PolicyProblem(name, 1, 1, f"larger than {MAX_POLICY_BYTES} bytes")])
    loader = None
    try:
        loader = _LimitedLoader(text)
        root = loader.get_single_node()
        return root, None if root is None else loader.construct_document(root)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        kind = "" if isinstance(error, _LimitError) else "invalid YAML: "
        raise PolicyError([PolicyProblem(name, line, column, f"{kind}{error.problem}")]) from None
    except yaml.reader.ReaderError as error:  # a control character: a binary file, most likely
        line, column = _position(text, error.position)
        code = error.character if isinstance(error.character, int) else ord(error.character)
        problem = f"invalid YAML: control character U+{code:04X} is not allowed (a binary file?)"
        raise PolicyError([PolicyProblem(name, line, column, problem)]) from None
    except Exception as error:  # a PyYAML bug must still be a PolicyError, never a crash
        raise PolicyError([PolicyProblem(name, 1, 1, f"invalid YAML: {error}")]) from None
    finally:
        if loader is not None:
            loader.dispose()


@dataclass(frozen=True, slots=True)
class PolicyProblem:
    file: str
    line: int
    column: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}: {self.message}"


class PolicyError(PermanentError):
    """Raised when a policy (or config) file does not validate, with one problem per file:line:column."""

    def __init__(self, problems: list[PolicyProblem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class LoadedPolicy:
    policy: Policy
    path: str
    sha256: str


def _node_at(root: yaml.Node, loc: tuple[int | str, ...], at_key: bool) -> yaml.Node:
    """The deepest YAML node along a pydantic error location (for its line and column).

    `at_key` points at the last key itself rather than its value: right for an unknown key.
    """
    node = root
    for depth, key in enumerate(loc, start=1):
        if isinstance(node, yaml.MappingNode):
            child = next(
                ((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None
            )
            if child is None:
                return node
            node = child[0] if at_key and depth == len(loc) else child[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            return node
    return node


def parse_policy(text: str, name: str) -> Policy:
    return parse_yaml(text, name, Policy, "a mapping with `rules:`")


def parse_yaml(text: str, name: str, model: type[M], expected: str) -> M:
    """YAML text → a validated model; every problem is reported at its file:line:column."""
    root, data = _load(text, name)
    if root is None or not isinstance(data, dict):
        raise PolicyError([PolicyProblem(name, 1, 1, f"expected {expected}")])
    try:
        return model.model_validate(data)
    except (OverflowError, RecursionError) as error:  # a number too large for a duration, say
        raise PolicyError([PolicyProblem(name, 1, 1, f"out of range: {error}")]) from None
    except ValidationError as error:
        problems = []
        for item in error.errors():
            loc = item["loc"]
            cause = item.get("ctx", {}).get("error")
            if isinstance(cause, DuplicateRuleId):
                loc = ("rules", cause.index, "id")  # the policy-level check knows which rule
            elif isinstance(cause, Located):
                loc = cause.loc
            node = _node_at(root, loc, at_key=item["type"] == "extra_forbidden")
            where = ".".join(map(str, loc)) or "policy"
            message = item["msg"].removeprefix("Value error, ")
            if item["type"] == "extra_forbidden":
                message = "unknown key"
            elif item["type"] in ("literal_error", "enum") and "expected" in item.get("ctx", {}):
                message = f"expected {item['ctx']['expected']}, got {item['input']!r}"
            problems.append(
                PolicyProblem(
                    name, node.start_mark.line + 1, node.start_mark.column + 1, f"{where}: {message}"
                )
            )
        raise PolicyError(problems) from None


def read_limited(path: Path) -> bytes:
    """A policy-like file's bytes; unreadable is a PolicyError naming it."""
    try:
        with path.open("rb") as handle:
            return handle.read(MAX_POLICY_BYTES + 1)  # a huge file is refused, not read whole
    except OSError as error:
        raise PolicyError([PolicyProblem(str(path), 0, 0, f"cannot read: {error.strerror}")]) from None


def load_policy(path: Path | str) -> LoadedPolicy:
    path = Path(path)
    raw = read_limited(path)
    return LoadedPolicy(_parsed(raw, str(path)), str(path), hashlib.sha256(raw).hexdigest())


@functools.lru_cache(maxsize=8)
def _parsed(raw: bytes, name: str) -> Policy:
    # The file is read at every decision so that an edit applies to the next incident; parsing
    # and validating it again (a third of a second for the default policy on a busy machine) only
    # when its bytes changed keeps that promise off the path from a fault to its drain. A frozen
    # model, so sharing one is safe; a file that fails to parse raises and is not kept.
    return parse_policy(decode_policy(raw, name), name)
