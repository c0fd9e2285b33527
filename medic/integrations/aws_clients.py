"""boto3 clients and node maps for the AWS providers, built from configuration.

Credentials are never read or passed here: boto3's standard chain finds them (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE and the shared config files, SSO, or the
instance / container role). The region comes from AWS_REGION or AWS_DEFAULT_REGION, else the profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import boto3
import yaml
from botocore.client import BaseClient
from botocore.config import Config

NODE_MAP_VAR = "MEDIC_AWS_NODE_MAP"

# botocore's standard mode already retries throttling and transient errors a few times with backoff;
# the providers' own Retrier (aws_retry.py) adds longer, bounded retries on top.
CLIENT_CONFIG = Config(retries={"mode": "standard", "max_attempts": 3}, user_agent_extra="gpu-medic")


def aws_client(service: str, env: Mapping[str, str]) -> BaseClient:
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    return boto3.session.Session(region_name=region).client(service, config=CLIENT_CONFIG)


def node_map(env: Mapping[str, str]) -> dict[str, str] | None:
    """The node name -> id map from the YAML or JSON file named by MEDIC_AWS_NODE_MAP, or None (discover)."""
    path = env.get(NODE_MAP_VAR)
    if not path:
        return None
    loaded = yaml.safe_load(Path(path).expanduser().read_text())
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()
    ):
        raise ValueError(f"{NODE_MAP_VAR}={path} must hold a mapping of node name to id (strings)")
    return loaded
