"""The audit and incident store (sqlmodel): SQLite by default, PostgreSQL via MEDIC_DATABASE_URL."""

from medic.store.store import IncidentDetail, Store, utcnow

__all__ = ["IncidentDetail", "Store", "utcnow"]
