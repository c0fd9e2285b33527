"""What an installation is made of: its version, its schema, its import contracts, and the commands that
put the shipped files in place (the wheel itself: tests/system/test_wheel.py)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from checkout import REPO_ROOT
from typer.testing import CliRunner

from medic import __version__
from medic.apps.cli.app import app
from medic.shipped import SHIPPED_POLICY, SLURM_HOOKS, SYSTEMD_UNITS
from medic.store.migrate import HEAD, SCHEMA_OF_RELEASE

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def contract(name: str) -> dict[str, object]:
    return next(c for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["name"].startswith(name))


def test_the_domain_is_named_alike_in_the_layers_and_in_what_it_may_not_import() -> None:
    layers = contract("Entry points")["layers"]
    assert isinstance(layers, list)
    domain = {f"medic.{m.strip()}" for m in layers[4].split(":")}
    assert domain == set(contract("The domain does no orchestration")["source_modules"])  # type: ignore[arg-type]


def test_this_release_names_its_store_schema_and_the_changelog_says_the_same() -> None:
    assert SCHEMA_OF_RELEASE[__version__] == HEAD
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
    entry = re.search(rf"^## {re.escape(__version__)}\b.*?(?=^## |\Z)", changelog, re.MULTILINE | re.DOTALL)
    assert entry, f"CHANGELOG.md has no entry for {__version__}"
    assert f"Store schema: {HEAD}" in entry.group(0)


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert (result.exit_code, result.output) == (0, f"gpu-medic {__version__}\n")


def test_policy_init_writes_the_shipped_policy_and_keeps_an_edited_one(tmp_path: Path) -> None:
    target = tmp_path / "site" / "policy.yaml"
    assert CliRunner().invoke(app, ["policy", "init", str(target)]).exit_code == 0
    assert target.read_bytes() == SHIPPED_POLICY.read_bytes()
    assert (tmp_path / "site" / "policy.tests.yaml").read_text().strip()
    target.write_text("edited\n")
    refused = CliRunner().invoke(app, ["policy", "init", str(target)])
    assert refused.exit_code == 1
    assert "--force replaces it" in refused.output
    assert target.read_text() == "edited\n"
    assert CliRunner().invoke(app, ["policy", "init", str(target), "--force"]).exit_code == 0
    assert target.read_bytes() == SHIPPED_POLICY.read_bytes()


def test_install_hooks_keeps_the_site_settings(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["node", "install-hooks", str(tmp_path)])
    assert result.exit_code == 0, result.output
    shipped = sorted(p.name for p in SLURM_HOOKS.glob("medic-*.sh"))
    assert shipped == ["medic-epilog.sh", "medic-healthcheck.sh", "medic-hook.sh", "medic-prolog.sh"]
    for name in shipped:
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o755
    settings = tmp_path / "medic-hooks.env"
    assert settings.stat().st_mode & 0o777 == 0o600  # it will hold the token
    assert re.search(r"^MEDIC_BIN=\S+", settings.read_text(), re.MULTILINE)
    settings.write_text("MEDIC_TOKEN=secret\n")
    again = CliRunner().invoke(app, ["node", "install-hooks", str(tmp_path)])
    assert again.exit_code == 0 and "kept" in again.output
    assert settings.read_text() == "MEDIC_TOKEN=secret\n"


@pytest.mark.parametrize("unit", ["medic-agent.service", "medic-serve.service", "medic-worker.service"])
def test_install_units_points_them_at_this_installation(tmp_path: Path, unit: str) -> None:
    assert CliRunner().invoke(app, ["node", "install-units", str(tmp_path)]).exit_code == 0
    written = (tmp_path / unit).read_text()
    assert "@BIN@" in (SYSTEMD_UNITS / unit).read_text() and "@BIN@" not in written
    (start,) = re.findall(r"^ExecStart=(\S+)", written, re.MULTILINE)
    assert Path(start).is_file(), start  # this virtualenv's `medic` or `prefect`
