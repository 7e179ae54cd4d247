"""Checks of command-line numbers shared by every service: each problem names its flag and the value given."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def flag(name: str) -> str:
    """The flag of an argparse attribute name: max_model_len -> --max-model-len."""
    return "--" + name.replace("_", "-")


def below_problem(args: argparse.Namespace, names: Iterable[str], least: float) -> str:
    """The first of `names` whose value is below `least`, as a message ("" when none is)."""
    for name in names:
        if not getattr(args, name) >= least:
            return f"{flag(name)} must be at least {least:g}, got {getattr(args, name)}"
    return ""


def not_positive_problem(args: argparse.Namespace, names: Iterable[str]) -> str:
    """The first of `names` whose value is not above 0, as a message ("" when none is)."""
    for name in names:
        if not getattr(args, name) > 0:
            return f"{flag(name)} must be positive, got {getattr(args, name)}"
    return ""
