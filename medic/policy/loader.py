"""Loading a policy file: YAML → validated `Policy`, with errors that point at file:line:column."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from medic.errors import PermanentError
from medic.policy.model import DuplicateRuleId, Policy

M = TypeVar("M", bound=BaseModel)


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
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise PolicyError([PolicyProblem(name, line, column, f"invalid YAML: {error.problem}")]) from None
    if root is None or not isinstance(data, dict):
        raise PolicyError([PolicyProblem(name, 1, 1, f"expected {expected}")])
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            loc = item["loc"]
            cause = item.get("ctx", {}).get("error")
            if isinstance(cause, DuplicateRuleId):
                loc = ("rules", cause.index, "id")  # the policy-level check knows which rule
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


def load_policy(path: Path | str) -> LoadedPolicy:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise PolicyError([PolicyProblem(str(path), 0, 0, f"cannot read: {error.strerror}")]) from None
    policy = parse_policy(raw.decode("utf-8", "replace"), str(path))
    return LoadedPolicy(policy, str(path), hashlib.sha256(raw).hexdigest())
