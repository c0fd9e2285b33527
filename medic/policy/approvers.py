"""Who may answer an approval: the policy names Slack users by id or by email, never by name.

A display name can be taken by anyone in the workspace, so a click is matched by the clicking
user's id alone. An email is turned into an id through the workspace's directory (Slack's
`users.lookupByEmail`); an email that cannot be turned into one lets nobody in, and says why.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from medic.errors import TransientError

# Slack's member ids: U... for a workspace's users, W... on Enterprise Grid.
USER_ID = re.compile(r"^[UW][A-Z0-9]{6,}$")
EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
APPROVER_PATTERN = rf"{USER_ID.pattern}|{EMAIL.pattern}"


def check_entry(entry: str) -> str:
    """An approver as the policy may list one: a Slack user id or an email."""
    if USER_ID.match(entry) or EMAIL.match(entry):
        return entry
    raise ValueError(
        f"{entry!r} is neither a Slack user id (U… or W…) nor an email: anyone can take a display "
        "name, so approvers are listed by id (Slack profile → ⋮ → Copy member ID) or email"
    )


def is_email(entry: str) -> bool:
    return EMAIL.match(entry) is not None


@runtime_checkable
class UserDirectory(Protocol):
    def user_id_by_email(self, email: str) -> str | None:
        """The id of the active user with this email; None when there is none. Raises a
        TransientError when the directory cannot be asked now."""
        ...


@dataclass(frozen=True, slots=True)
class Approvers:
    """The Slack user ids allowed to answer, and why any listed approver is not among them."""

    ids: frozenset[str] = frozenset()
    problems: tuple[str, ...] = ()
    retry: bool = False  # a lookup failed for a reason that may pass: worth asking again later


def resolve(entries: Sequence[str], directory: UserDirectory | None) -> Approvers:
    """Ids stand as listed; each email is looked up once. Never raises: a failure is a problem."""
    ids: set[str] = set()
    problems: list[str] = []
    retry = False
    for entry in entries:
        if not is_email(entry):
            ids.add(entry)
            continue
        if directory is None:
            problems.append(f"{entry}: not resolved, Slack is not configured (no bot token)")
            continue
        try:
            found = directory.user_id_by_email(entry)
        except TransientError as error:
            retry = True
            problems.append(f"{entry}: not resolved yet, Slack could not be asked ({error})")
            continue
        except Exception as error:  # a refusal (missing_scope, invalid_auth) or a fault: said, not fatal
            problems.append(f"{entry}: not resolved ({error})")
            continue
        if found is None:
            problems.append(f"{entry}: no active Slack user has this email")
        else:
            ids.add(found)
    return Approvers(frozenset(ids), tuple(problems), retry)
