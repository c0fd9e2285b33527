"""Nothing secret in serve's access log: query-string values are replaced before a line is written.

GPU Medic takes credentials in headers only, but a client that puts a token in the URL
(`?token=…`) would otherwise have it written to the access log, which is kept and shipped
with far less care than a secret.
"""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
REDACTED = "***"


def redact_query(path: str) -> str:
    """`/v1/events?token=s3cret&x` → `/v1/events?token=***&x=***`: names kept, every value hidden."""
    route, sep, query = path.partition("?")
    if not sep:
        return path
    names = (pair.partition("=")[0] for pair in query.split("&") if pair)
    return f"{route}?{'&'.join(f'{name}={REDACTED}' for name in names)}"


class RedactQuery(logging.Filter):
    """For uvicorn's access records, whose args are (client, method, path, http version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (args[0], args[1], redact_query(args[2]), args[3], args[4])
        return True


def install() -> None:
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactQuery) for f in logger.filters):
        logger.addFilter(RedactQuery())
