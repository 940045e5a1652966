"""The store: PostgreSQL is the only authority. Everything that reads or writes it goes through
`Store`; nothing above this package imports the driver: the store raises its own errors
(`podium.errors.StoreUnavailable`, `Contention`), hands out `Subscription`s rather than connections,
and returns its own row types."""

from podium.store.db import ROOM_FREED, AuditEntry, Change, Notification, Store, Subscription, Transition

__all__ = ["ROOM_FREED", "AuditEntry", "Change", "Notification", "Store", "Subscription", "Transition"]
