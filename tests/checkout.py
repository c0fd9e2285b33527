"""The repository the tests run from: its fixtures, scripts and docs (never what the product reads)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_FIXTURES = (
    REPO_ROOT / "tests" / "fixtures"
)  # documents written by others, each folder's SOURCES says whose
