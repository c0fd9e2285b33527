"""The audit and incident store (sqlmodel): SQLite by default, PostgreSQL via MEDIC_DATABASE_URL."""

from medic.store.engine import utcnow
from medic.store.incidents import IncidentDetail
from medic.store.store import Store

__all__ = ["IncidentDetail", "Store", "utcnow"]
