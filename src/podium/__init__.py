"""Podium: a control plane that runs work on a fleet of machines and tells the truth about it."""

__version__ = "0.1.0"
