"""The Slack `Notifier`: one message per incident (Block Kit), progress as replies in its thread.

Retries are done here rather than by slack-sdk's retry handlers: its RateLimitErrorRetryHandler crashes on
a fractional Retry-After ("2.5" → ValueError) and none of its handlers bound the total time spent, while
the flow must hear within `max_wait_s` that Slack is unreachable so that it can record it and go on.
"""

from __future__ import annotations

import http.client
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry import BackoffRetryIntervalCalculator
from slack_sdk.web import SlackResponse

from medic.artifacts import ArtifactLinks
from medic.errors import MedicError, PermanentError, TransientError
from medic.integrations.slack.blocks import TEXT_MAX, fallback_text, fit_mrkdwn, message_blocks, truncate
from medic.protocols import Message

log = logging.getLogger(__name__)

DEFAULT_API_URL = WebClient.BASE_URL
# One request must not eat the whole retry budget when Slack accepts the connection and then hangs.
REQUEST_TIMEOUT_S = 10
TOKEN_ENV = "SLACK_BOT_TOKEN"
TOKEN_BLOCK_ENV = "MEDIC_SLACK_TOKEN_BLOCK"
API_URL_ENV = "SLACK_API_URL"
# A 5xx answer can carry a whole HTML page; the error message keeps its start.
PROBLEM_MAX = 300

FlowRunUrl = Callable[[Message], str | None]


class NotifyError(MedicError, RuntimeError):
    """Raised when Slack did not take the message; the subclasses say whether it refused it or stayed
    unavailable."""


class NotifyRefusedError(NotifyError, PermanentError):
    """Raised when Slack refused the call (invalid_auth, channel_not_found): asking again cannot help."""


class NotifyUnavailableError(NotifyError, TransientError):
    """Raised when Slack stayed unreachable, rate-limited or failing (5xx) for longer than `max_wait_s`."""


def retry_after_s(headers: Mapping[str, Any]) -> float | None:
    """Seconds Slack asked us to wait, from a Retry-After header in seconds (Slack sends integers; a
    fractional value is honoured too). None when the header is missing or unreadable."""
    for name, value in headers.items():
        if name.lower() == "retry-after":
            raw = value[0] if isinstance(value, list) else value
            try:
                seconds = float(raw)
            except (TypeError, ValueError):
                return None
            return max(seconds, 0.0) if math.isfinite(seconds) else None
    return None


def split_thread(thread: str) -> tuple[str, str]:
    channel, sep, ts = thread.rpartition(":")
    if not sep or not channel or not ts:
        raise ValueError(f"not a Slack thread reference (channel:ts): {thread!r}")
    return channel, ts


def current_flow_run_url(_message: Message) -> str | None:
    """The Prefect UI page of the flow run this is called from, when Prefect knows its UI's address
    (PREFECT_UI_URL, or derived from PREFECT_API_URL)."""
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL

    if not PREFECT_UI_URL.value() or not flow_run.id:
        return None
    return flow_run.ui_url


def token_from_env(env: Mapping[str, str]) -> str | None:
    """SLACK_BOT_TOKEN, else the Prefect Secret block named by MEDIC_SLACK_TOKEN_BLOCK; None when neither."""
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    block = env.get(TOKEN_BLOCK_ENV)
    if not block:
        return None
    from prefect.blocks.system import Secret  # imported late: only this configuration needs it

    # _sync: Block.load returns a coroutine when called from async code unless told otherwise. Prefect's
    # async_dispatch typing knows neither the argument nor that it makes the result the block itself.
    return str(Secret.load(block, _sync=True).get())  # type: ignore[call-arg, union-attr]


class SlackNotifier:
    def __init__(
        self,
        client: WebClient,
        *,
        flow_run_url: FlowRunUrl | None = None,
        artifact_links: ArtifactLinks | None = None,
        max_wait_s: float = 30,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._flow_run_url = flow_run_url
        self._artifact_links = artifact_links
        self.max_wait_s = max_wait_s
        self._sleep = sleep
        self._clock = clock
        # slack-sdk's own exponential backoff with jitter: 0.5 s, 1 s, 2 s, ... plus up to 1 s.
        self._backoff = BackoffRetryIntervalCalculator(backoff_factor=0.5)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlackNotifier | None:
        """A notifier configured by SLACK_BOT_TOKEN (or the Prefect Secret block named by
        MEDIC_SLACK_TOKEN_BLOCK), SLACK_API_URL, and MEDIC_ARTIFACT_ROOT / MEDIC_ARTIFACT_URL for links
        to evidence files; None when no token is configured. A malformed setting raises ValueError."""
        env = os.environ if env is None else env
        token = token_from_env(env)
        if not token:
            return None
        base_url = env.get(API_URL_ENV) or DEFAULT_API_URL
        client = WebClient(
            token=token,
            base_url=base_url.rstrip("/") + "/",
            timeout=REQUEST_TIMEOUT_S,
            retry_handlers=[],  # all retrying happens in _call, inside one time budget
        )
        return cls(client, flow_run_url=current_flow_run_url, artifact_links=ArtifactLinks.from_env(env))

    def __repr__(self) -> str:
        return f"SlackNotifier(base_url={self._client.base_url!r}, max_wait_s={self.max_wait_s})"

    def post(self, message: Message) -> str:
        """Posts the incident message; returns "channel_id:ts", the reference for replies and updates."""
        url = self._flow_run_url(message) if self._flow_run_url else None
        response = self._call(
            "chat.postMessage",
            self._client.chat_postMessage,
            channel=message.channel,
            text=fallback_text(message),
            blocks=message_blocks(message, url, self._artifact_links),
            unfurl_links=False,
        )
        # Slack answers with the channel's id even when posted by name; chat.update accepts only the id.
        return f"{response['channel']}:{response['ts']}"

    def reply(self, thread: str, text: str) -> None:
        channel, ts = split_thread(thread)
        self._call(
            "chat.postMessage",
            self._client.chat_postMessage,
            channel=channel,
            thread_ts=ts,
            text=fit_mrkdwn(text, TEXT_MAX),
        )

    def update(self, thread: str, message: Message) -> None:
        """Rewrites the thread's first message, e.g. when the incident is resolved."""
        channel, ts = split_thread(thread)
        url = self._flow_run_url(message) if self._flow_run_url else None
        self._call(
            "chat.update",
            self._client.chat_update,
            channel=channel,
            ts=ts,
            text=fallback_text(message),
            blocks=message_blocks(message, url, self._artifact_links),
        )

    def user_id_by_email(self, email: str) -> str | None:
        """The id of the active Slack user with this email (`users.lookupByEmail`, which needs the
        `users:read.email` scope); None when Slack has none, or only a deactivated one."""
        try:
            response = self._call("users.lookupByEmail", self._client.users_lookupByEmail, email=email)
        except NotifyRefusedError as error:
            cause = error.__cause__
            if isinstance(cause, SlackApiError) and cause.response.get("error") == "users_not_found":
                return None
            raise
        user = response.get("user") or {}
        if user.get("deleted") or not user.get("id"):
            return None
        return str(user["id"])

    def _api_pause(self, attempt: int, error: SlackApiError) -> float | None:
        """How long to wait before trying again after Slack answered with an error; None when trying again
        cannot help (a refusal such as invalid_auth or channel_not_found)."""
        status = error.response.status_code
        if status == 429:
            asked = retry_after_s(error.response.headers)
            return self._backoff.calculate_sleep_duration(attempt) if asked is None else asked
        if status >= 500:
            return self._backoff.calculate_sleep_duration(attempt)
        return None

    def _call(self, method: str, fn: Callable[..., SlackResponse], **kwargs: Any) -> SlackResponse:
        deadline = self._clock() + self.max_wait_s
        attempt = 0
        failure: Exception  # the last try's error, which the one raised when giving up is raised from
        while True:
            try:
                return fn(**kwargs)
            except SlackApiError as error:
                failure, pause = error, self._api_pause(attempt, error)
                problem = f"HTTP {error.response.status_code} {error.response.get('error', '')}"
            except (OSError, http.client.HTTPException) as error:
                # The connection failed or broke: Slack may be back in a moment.
                failure, pause = error, self._backoff.calculate_sleep_duration(attempt)
                problem = f"{type(error).__name__}: {error}"
            problem = truncate(problem.strip(), PROBLEM_MAX)
            if pause is None:
                raise NotifyRefusedError(f"Slack refused {method}: {problem}") from failure
            if self._clock() + pause > deadline:
                raise NotifyUnavailableError(
                    f"Slack {method} failed {attempt + 1} time(s), last with {problem}; "
                    f"gave up rather than wait longer than {self.max_wait_s:g} s in all"
                ) from failure
            log.warning("Slack %s failed (%s); retry %d in %.2f s", method, problem, attempt + 1, pause)
            self._sleep(pause)
            attempt += 1
