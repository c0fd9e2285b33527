"""One file, one path, one module (docs/decisions/0012-one-import-namespace.md): every file lives under
medic/, the customer's top-level folders are links into it, and no module loads under a second name —
not even with the repository's root on sys.path, as `python -m` from the root puts it.

And the measures that keep the hubs from growing back (issue 49): no function over 80 lines in the
entry points, the flows or the tasks, and no private name imported from another module."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from checkout import REPO_ROOT

MEDIC = REPO_ROOT / "medic"
MAX_FUNCTION_LINES = 80
# The layers whose functions are orchestration, where a long function is a hub growing.
HUB_LAYERS = ("apps", "flows", "tasks")


def tracked_links() -> dict[Path, Path]:
    """Every symbolic link git tracks, and where it resolves."""
    listed = subprocess.run(
        ["git", "ls-files", "-s"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    links = [line.split("\t", 1)[1] for line in listed.splitlines() if line.startswith("120000 ")]
    return {REPO_ROOT / link: (REPO_ROOT / link).resolve() for link in links}


def test_every_link_points_into_the_package_and_none_lives_inside_it() -> None:
    links = tracked_links()
    assert links, "the customer's top-level folders are links into medic/"
    for link, target in links.items():
        assert target.is_relative_to(MEDIC), f"{link} -> {target}: a link leads into medic/ only"
        assert not link.is_relative_to(MEDIC), f"{link}: a file under medic/ has no second path"
    assert {link.relative_to(REPO_ROOT).as_posix() for link in links} >= {
        "flows",
        "tasks",
        "integrations",
        "policies",
        "deployments/training",
    }


def other_names() -> list[str]:
    """Each dotted name under which a module of medic/ could be imported from the repository's root,
    through a link: `tasks.nodes.guard` for medic/tasks/nodes/guard.py."""
    names = []
    for link, target in tracked_links().items():
        if not (target / "__init__.py").exists():
            continue  # package data (policies, hook scripts, units): no module to load twice
        prefix = link.relative_to(REPO_ROOT).as_posix().replace("/", ".")
        for file in sorted(target.rglob("*.py")):
            parts = file.relative_to(target).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names.append(".".join((prefix, *parts)))
    return names


IMPORT_EVERYTHING = """
import importlib, json, os, pkgutil, sys
import medic
refused, loaded = {}, []
for info in pkgutil.walk_packages(medic.__path__, "medic."):
    # alembic runs the migrations' scripts itself, inside its own context
    if ".migrations" not in info.name and not info.name.endswith("__main__"):
        importlib.import_module(info.name)
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
        loaded.append(name)
    except ImportError as error:
        refused[name] = str(error)
files = {}
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if path and os.path.realpath(path).startswith(os.path.join(os.getcwd(), "medic") + os.sep):
        files.setdefault(os.path.realpath(path), []).append(name)
twice = {path: names for path, names in files.items() if len(names) > 1}
print(json.dumps({"loaded": loaded, "refused": refused, "twice": twice}))
"""


def test_no_module_loads_under_two_names_with_the_root_on_sys_path() -> None:
    names = other_names()
    assert "tasks.nodes.guard" in names and "deployments.training.medic_hooks" in names
    # `python -c` from the root puts the root first on sys.path, as `python -m` does.
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING, json.dumps(names)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["loaded"] == [], "loadable under a second name"
    assert result["twice"] == {}, "one file, two module objects"
    assert set(result["refused"]) == set(names)
    assert "is medic.tasks: import it by that name" in result["refused"]["tasks.nodes.guard"]


def python_files(*layers: str) -> list[Path]:
    return sorted(file for layer in layers for file in (MEDIC / layer).rglob("*.py"))


def long_functions(files: list[Path]) -> list[str]:
    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{file}:{node.lineno} {node.name}: {lines} lines")
    return found


def private_imports(files: list[Path]) -> list[str]:
    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found += [
                    f"{file}:{node.lineno} {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    return found


def test_no_function_in_the_entry_points_flows_or_tasks_is_over_80_lines() -> None:
    assert long_functions(python_files(*HUB_LAYERS)) == []


def test_no_private_name_is_imported_from_another_module() -> None:
    assert private_imports(sorted(MEDIC.rglob("*.py")) + sorted((REPO_ROOT / "tests").rglob("*.py"))) == []


def test_the_measures_see_what_they_forbid(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    sample.write_text(f"from medic.apps.cli.incidents import _hidden, shown\n\n\ndef f():\n{body}\n")
    assert long_functions([sample]) == [f"{sample}:4 f: {MAX_FUNCTION_LINES + 1} lines"]
    assert private_imports([sample]) == [f"{sample}:1 medic.apps.cli.incidents._hidden"]


def test_the_architecture_s_map_names_files_that_exist() -> None:
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## An incident, stage by stage", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(medic/[\w/]+\.py)`", section))
    assert len(named) >= 30
    assert sorted(p for p in named if not (REPO_ROOT / p).is_file()) == []
    stages = [
        row.split("|")[1].strip() for row in section.splitlines() if row.startswith("| ") and "---" not in row
    ]
    assert stages[1:] == [
        "intake",
        "job signals",
        "open",
        "contain",
        "triage",
        "decide",
        "diagnose",
        "approve",
        "act",
        "resume",
        "verify",
        "notify",
        "close",
    ]
