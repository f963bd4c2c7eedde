"""Command-line interface: one module per command, joined here."""

from specdec_cli.cli.app import app, main

__all__ = ["app", "main"]
