"""The `podium` command line (Typer + Rich)."""
