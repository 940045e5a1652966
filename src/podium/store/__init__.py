"""The store: PostgreSQL is the only authority. Everything that reads or writes it goes through
`Store`; nothing above this package imports the driver."""

from podium.store.db import Change, Store, Transition

__all__ = ["Change", "Store", "Transition"]
