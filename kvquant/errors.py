"""Errors that carry one line a user can act on.

Every user-facing failure (bad name, missing file, offline hub, impossible parameter) raises a
``KvquantError``; ``run.py`` prints its message alone, without a traceback.
"""

from __future__ import annotations


class KvquantError(Exception):
    """Base class: the message says what is wrong and how to fix it."""


class UnknownNameError(KvquantError, KeyError):
    """A model, method or task name that no registry knows."""

    def __init__(self, kind: str, name: str, valid: list[str]):
        self.kind, self.name, self.valid = kind, name, sorted(valid)
        super().__init__(f"unknown {kind} '{name}'; valid {kind}s: {', '.join(self.valid)}")

    def __str__(self) -> str:
        return self.args[0]


class ModelUnavailableError(KvquantError):
    """A model whose files are missing or cannot be fetched (offline hub)."""


class InvalidParameterError(KvquantError, ValueError):
    """A method or task parameter outside what the method supports."""
