"""Alembic's entry: migrations run on the connection medic.store.migrate hands over, inside its
transaction and lock; there is no alembic.ini and no URL of its own."""

from alembic import context

config = context.config
context.configure(
    connection=config.attributes["connection"], version_table=config.attributes["version_table"]
)
with context.begin_transaction():
    context.run_migrations()
