"""The root command line: `medic COMMAND` loads that command's module only, and says what the whole
CLI says (medic/apps/cli/app.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from medic.apps.cli.app import COMMANDS, app, build

runner = CliRunner()

# What `medic NAME` must not load for `policy`: the other families' heavy imports.
_OTHERS = (
    "medic.apps.cli.serve",
    "medic.apps.cli.report",
    "medic.apps.cli.simulate",
    "medic.apps.cli.demo",
    "prefect",
    "httpx",
)


def test_the_root_lists_every_command_in_order() -> None:
    group = get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    assert list(group.list_commands(typer.Context(group))) == list(COMMANDS)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_command_alone_reads_as_in_the_whole_cli(name: str) -> None:
    whole = runner.invoke(app, [name, "--help"], prog_name="medic")
    alone = runner.invoke(build([name]), [name, "--help"], prog_name="medic")
    assert whole.exit_code == alone.exit_code == 0
    assert alone.output == whole.output


def _load(argv: list[str]) -> dict[str, object]:
    """Run `medic ARGV` in a fresh interpreter; what it printed and which modules it loaded."""
    code = (
        "import json, sys\n"
        f"sys.argv = ['medic', *{argv!r}]\n"
        "from medic.apps.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit as stop:\n    code = stop.code\n"
        "print(json.dumps({'code': code, 'modules': sorted(sys.modules)}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def test_a_command_loads_its_own_module_and_not_the_others() -> None:
    loaded = _load(["policy", "--help"])
    assert loaded["code"] == 0
    modules = set(loaded["modules"])  # type: ignore[arg-type]
    assert "medic.apps.cli.policy" in modules
    assert not [m for m in _OTHERS if m in modules]


def test_the_root_help_and_an_unknown_name_load_every_command() -> None:
    for argv, code in (["--help"], 0), (["no-such-command"], 2):
        loaded = _load(argv)
        assert loaded["code"] == code
        assert {module for module, _ in COMMANDS.values()} <= set(loaded["modules"])  # type: ignore[arg-type]
