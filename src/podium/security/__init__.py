"""Identities (operator tokens, join tokens, node credentials), roles, and secrets at rest."""
