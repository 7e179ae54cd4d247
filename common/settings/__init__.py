"""Every command-line setting of every service and of `specserve up`, defined once: its flag, type, default, help and
the services that take it (common/settings/table.py holds them; this module builds parsers and command lines from them).

A service's parser comes from here (`add_arguments`), `specserve up` writes the command line of each process it starts
from here (`argv`: a name no service takes is an error there, not a flag the process refuses at start), and the
docker-compose.yml file's variables are held to it by a test. A setting two services take alike is one entry naming
both; one that means something else in another service (the scheduler's --step-timeout-s against a worker's) is an
entry of its own. Torch-free: the scheduler and the gateway parse their flags from it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from common.settings.setting import SERVICES, Service, Setting
from common.settings.table import SETTINGS

__all__ = ["SERVICES", "SETTINGS", "Service", "Setting", "add_arguments", "argv", "of_service"]


def of_service(service: Service) -> list[Setting]:
    """The settings `service` takes, in the table's order."""
    return [setting for setting in SETTINGS if service in setting.services]


def add_arguments(parser: argparse.ArgumentParser, service: Service) -> None:
    """Every setting of `service` as a flag of `parser`."""
    for setting in of_service(service):
        default = setting.default
        if setting.default_env is not None:  # read when the parser is built: a process sees its own environment
            default = os.environ.get(setting.default_env) or default
        if setting.action == "switch":
            parser.add_argument(setting.flag, action="store_true", help=setting.help, dest=setting.dest)
        elif setting.action == "toggle":
            parser.add_argument(
                setting.flag,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=setting.help,
                dest=setting.dest,
            )
        else:
            parser.add_argument(
                setting.flag,
                action=setting.action,
                type=setting.type or str,
                choices=setting.choices,
                default=[] if setting.action == "append" else default,
                required=setting.required,
                help=setting.help,
                dest=setting.dest,
            )


def argv(service: Service, values: Mapping[str, object]) -> list[str]:
    """The command line giving `service` these values (by the settings' dest names), in the order given.

    None leaves a setting to the service's default; a switch is given when true; a toggle as --flag or --no-flag; a
    list as the flag once per item. A name `service` does not take raises KeyError: a launcher cannot pass a setting
    the service does not have.
    """
    taken = {setting.dest: setting for setting in of_service(service)}
    line: list[str] = []
    for name, value in values.items():
        if name not in taken:
            raise KeyError(f"{service} takes no setting {name!r}")
        setting = taken[name]
        if value is None:
            continue
        if setting.action == "switch":
            line += [setting.flag] if value else []
        elif setting.action == "toggle":
            line.append(setting.flag if value else "--no-" + setting.flag[2:])
        elif setting.action == "append":
            assert isinstance(value, Sequence) and not isinstance(value, str), name
            for item in value:
                line += [setting.flag, str(item)]
        else:
            line += [setting.flag, str(value)]
    return line
