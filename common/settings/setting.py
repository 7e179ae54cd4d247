"""One command-line setting: what the table (common/settings/table.py) holds for each flag."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Service = Literal["scheduler", "worker", "draft", "gateway", "up"]
SERVICES: tuple[Service, ...] = ("scheduler", "worker", "draft", "gateway", "up")
Action = Literal["store", "switch", "toggle", "append"]


@dataclass(frozen=True)
class Setting:
    flag: str  # "--max-model-len"
    services: tuple[Service, ...]  # the processes (and `up`) that take it
    help: str
    type: Callable[[str], Any] | None = None  # None: the text as given
    default: Any = None
    choices: tuple[str, ...] | None = None
    # store: a value; switch: on when given (off by default); toggle: --flag or --no-flag; append: given again for more.
    action: Action = "store"
    required: bool = False
    default_env: str | None = None  # the environment variable that gives its default, when set
    env: str | None = None  # the docker-compose.yml variable that sets it there
    # Where a process runs and finds its peers (addresses, ports, files, ids, log format, grace under a supervisor):
    # chosen per deployment, so a stack started by compose, by `up` and by hand may differ in it.
    deployment: bool = False

    @property
    def dest(self) -> str:
        """The attribute name argparse gives it: --max-model-len -> max_model_len."""
        return self.flag.removeprefix("--").replace("-", "_")


def path_or_none(value: str) -> Path | None:
    """A file flag's value: "" is none (docker-compose.yml passes its settings through whether or not they are set)."""
    return Path(value) if value else None
