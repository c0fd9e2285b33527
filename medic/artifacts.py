"""The files an incident's evidence points at (a hung rank's stack dump, a slow rank's profile) and
where people can open them.

Events name them in `attributes.artifact`: a path on the job's shared file system (docs/culprit.md);
a straggler whose profile was compared with a healthy peer's also names the peer's trace
(`attributes.straggler_cause_peer_artifact`), so that people can open the two side by side.
The stages that keep files of their own (the host evidence read before a reboot or replacement,
docs/host-evidence.md) name them in their step's `artifacts` detail.
A path is no link in chat, so where a web server serves that file system, MEDIC_ARTIFACT_ROOT (the
directory) and MEDIC_ARTIFACT_URL (the URL it is served at) turn a path under the root into its URL
(docs/config.md). Any other path is shown as it is.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import quote

from medic.events import FaultEvent

ARTIFACT_URL_VAR = "MEDIC_ARTIFACT_URL"
ARTIFACT_ROOT_VAR = "MEDIC_ARTIFACT_ROOT"
PEER_ARTIFACT = "straggler_cause_peer_artifact"
# Slack reads <, > and | as link markup; whitespace ends a URL in any chat.
_URL = re.compile(r"https?://[^\s<>|]+")


@dataclass(frozen=True, slots=True)
class Artifact:
    what: str  # for people: "profile of rank 2 on node-b"
    path: str


def _what(event: FaultEvent) -> str:
    attributes = event.attributes
    if "profile_event" in attributes or attributes.get("check") == "profile":
        kind = "profile"
    elif "stall_event" in attributes or attributes.get("check") == "stall":
        kind = "stack dump"
    else:
        kind = f"{event.kind.value} artifact"
    rank = "" if event.rank is None else f" of rank {event.rank}"
    return f"{kind}{rank} on {event.node}"


def _peer(event: FaultEvent) -> str:
    rank = "" if event.rank is None else f" rank {event.rank} on"
    return f"profile of a healthy peer, against{rank} {event.node}"


def artifacts_of(events: Iterable[FaultEvent]) -> tuple[Artifact, ...]:
    """Each file the events point at, once, in the order the events name them (a straggler's own
    trace before its healthy peer's)."""
    found: dict[str, Artifact] = {}
    for event in events:
        for path, what in (
            (event.attributes.get("artifact"), _what),
            (event.attributes.get(PEER_ARTIFACT), _peer),
        ):
            if isinstance(path, str) and path and path not in found:
                found[path] = Artifact(what(event), path)
    return tuple(found.values())


def step_artifacts(details: Iterable[Mapping[str, Any] | None]) -> tuple[Artifact, ...]:
    """Each file the steps' `artifacts` details name (`[{"what": ..., "path": ...}]`), once, in order."""
    found: dict[str, Artifact] = {}
    for detail in details:
        for kept in (detail or {}).get("artifacts") or ():
            path = kept.get("path") if isinstance(kept, Mapping) else None
            if isinstance(path, str) and path and path not in found:
                found[path] = Artifact(str(kept.get("what") or path), path)
    return tuple(found.values())


@dataclass(frozen=True, slots=True)
class ArtifactLinks:
    """Paths under `root` as URLs under `base_url`."""

    root: PurePosixPath
    base_url: str

    def url(self, path: str) -> str | None:
        """The URL of `path`, or None when it is not a file under the root (`..` cannot climb out)."""
        normal = PurePosixPath(posixpath.normpath(path))
        if not normal.is_absolute() or normal == self.root or not normal.is_relative_to(self.root):
            return None
        return f"{self.base_url.rstrip('/')}/{quote(normal.relative_to(self.root).as_posix())}"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ArtifactLinks | None:
        """The mapping MEDIC_ARTIFACT_ROOT and MEDIC_ARTIFACT_URL set; None unless both are set.
        Raises ValueError naming the variable that is malformed."""
        url, root = env.get(ARTIFACT_URL_VAR), env.get(ARTIFACT_ROOT_VAR)
        if not url or not root:
            return None
        if not _URL.fullmatch(url):
            raise ValueError(f"{ARTIFACT_URL_VAR}={url!r}: must be an http(s) URL without spaces, <, > or |")
        if not root.startswith("/"):
            raise ValueError(f"{ARTIFACT_ROOT_VAR}={root!r}: must be an absolute path")
        return cls(PurePosixPath(posixpath.normpath(root)), url)
