"""The settings table (common/settings): every service's parser and `up`'s command lines come from it, the compose
file's variables are its settings, and a stack resolves to the same settings whether docker compose, `specserve up`
or a person starting each process by hand starts it."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import draft_service.config
import gateway.config
import gpu_worker.config
import scheduler.config
from common import settings
from common.settings import SERVICES, Service, Setting
from common.settings.setting import path_or_none
from common.transport import make_keys
from specserve.stack import StackAddresses, service_specs
from specserve.up import add_up_arguments, up_config

ROOT = Path(__file__).resolve().parents[2]
_VARIABLE = re.compile(r"\$\{(SPECSERVE_[A-Z_]+):-([^}]*)\}")
# The compose services -> the service whose settings they take, and the `specserve` command that runs it.
COMPOSE_SERVICES: dict[str, Service] = {
    "scheduler": "scheduler",
    "worker": "worker",
    "gpu-worker": "worker",
    "draft": "draft",
    "gateway": "gateway",
}
# Where the compose file's default is the service's own default, written where the image keeps it.
COMPOSE_OWN_DEFAULTS = {
    ("draft", "--proposer"): "the shipped draft, where the image keeps it (the draft service's own default finds it "
    "beside the source tree)",
}


def _parser(service: Service) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=service, exit_on_error=False)
    if service == "up":
        add_up_arguments(parser)
    else:
        settings.add_arguments(parser, service)
    return parser


def _sample(setting: Setting) -> Any:
    """A value of the setting's kind other than its default."""
    if setting.action == "switch":
        return True
    if setting.action == "toggle":
        return not setting.default
    if setting.action == "append":
        return ["a", "b"]
    if setting.choices:
        return next(choice for choice in reversed(setting.choices) if choice != setting.default)
    return {int: 7, float: 2.5, Path: Path("/x"), path_or_none: Path("/x"), None: "text"}[setting.type]


def test_a_flag_is_one_setting_of_a_service() -> None:
    for service in SERVICES:
        flags = [setting.flag for setting in settings.of_service(service)]
        assert len(flags) == len(set(flags)), service
        assert all(re.fullmatch(r"--[a-z0-9]+(-[a-z0-9]+)*", flag) for flag in flags)
        assert all(setting.help for setting in settings.of_service(service))


@pytest.mark.parametrize("service", SERVICES)
def test_a_command_line_written_from_the_table_gives_each_value(service: Service) -> None:
    values = {setting.dest: _sample(setting) for setting in settings.of_service(service)}
    args = _parser(service).parse_args(settings.argv(service, values))
    for name, value in values.items():
        assert getattr(args, name) == value, name


def test_a_value_left_none_is_the_services_default_and_a_toggle_off_is_its_no_flag() -> None:
    assert settings.argv("scheduler", {"max_num_seqs": None, "prefix_cache": False}) == ["--no-prefix-cache"]
    assert settings.argv("worker", {"require_batch_invariance": False, "page_size": 32}) == ["--page-size", "32"]
    defaults = _parser("scheduler").parse_args([])
    assert defaults.max_num_seqs == 256 and defaults.prefix_cache is True


def test_a_setting_the_service_does_not_take_is_refused_where_the_line_is_written() -> None:
    with pytest.raises(KeyError, match="scheduler takes no setting 'page_size'"):
        settings.argv("scheduler", {"page_size": 16})


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def test_the_compose_files_variables_are_settings_of_the_table_with_its_defaults() -> None:
    for name, service in COMPOSE_SERVICES.items():
        command = _compose()["services"][name]["command"]
        taken = {setting.flag: setting for setting in settings.of_service(service)}
        flags = [part for part in command[1:] if part.startswith("--")]
        assert not set(flags) - set(taken), (name, set(flags) - set(taken))
        for flag in flags:
            value = command[command.index(flag) + 1]
            setting = taken[flag]
            if not (match := _VARIABLE.fullmatch(value)):
                continue
            assert setting.env == match.group(1), (name, flag)
            if setting.deployment or (service, flag) in COMPOSE_OWN_DEFAULTS:
                continue
            expected = "" if setting.action == "append" else str(setting.default)
            assert match.group(2) == expected, (name, flag)
        for setting in taken.values():  # a setting with a compose variable is set through it wherever compose sets it
            if setting.env is not None and setting.flag in flags:
                assert f"${{{setting.env}:-" in command[command.index(setting.flag) + 1], (name, setting.flag)


# ---------------------------------------------------------------- compose, up and by hand


def _compose_argv(name: str, variables: dict[str, str], keys: Path) -> list[str]:
    """A compose service's command line as compose gives it, `variables` set (the rest their defaults)."""
    command = _compose()["services"][name]["command"]
    resolved = [_VARIABLE.sub(lambda match: variables.get(match.group(1), match.group(2)), part) for part in command]
    return [str(keys) if part == "/keys" else part for part in resolved[1:]]


# What each resolved config holds that a deployment chooses (addresses, ids, files, the model's path, keys, TLS, the
# grace its process manager gives it): a stack started another way may differ there and nowhere else.
_DEPLOYED = {
    "scheduler": {"gateway_address", "worker_address", "status_file", "keys", "insecure_loopback"},
    "worker": {"process", "model"},
    "process": {"worker_id", "scheduler_address", "status_file", "transport"},
    "draft": {"process", "proposer", "target_model"},
    "gateway": {
        "model_dir",
        "scheduler_address",
        "host",
        "port",
        "http_port",
        "gateway_id",
        "shutdown_grace_s",
        "transport",
        "tls",
        "log_json",
    },
}


def _settled(config: Any, kind: str) -> dict[str, Any]:
    """A resolved config's fields, less what the deployment chose; a process's own fields and a proposer's kind and
    folder name in their place."""
    fields = {
        field.name: getattr(config, field.name)
        for field in dataclasses.fields(config)
        if field.name not in _DEPLOYED[kind]
    }
    if kind in ("worker", "draft"):
        fields["process"] = _settled(config.process, "process")
    if kind == "draft":
        fields["proposer"] = (config.proposer.kind, config.proposer.path and config.proposer.path.name)
    return fields


def _resolved(service: Service, argv: list[str]) -> dict[str, Any]:
    """What the service makes of this command line, as its own start-up resolves it."""
    if service == "gateway":
        return _settled(gateway.config.parse_config(argv), "gateway")
    args = _parser(service).parse_args(argv)
    build = {
        "scheduler": scheduler.config.from_arguments,
        "worker": gpu_worker.config.from_arguments,
        "draft": draft_service.config.from_arguments,
    }[service]
    return _settled(build(args), service)


def test_a_stack_started_by_compose_by_up_and_by_hand_resolves_to_the_same_settings(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys)
    up = up_config(_parser("up").parse_args(["--keys", str(keys)]))
    model = up.stack.model
    addresses = StackAddresses("127.0.0.1", 50051, 8000, "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556")
    by_up = {spec.name: spec.argv[3:] for spec in service_specs(up.stack, addresses)}  # past `python -m MODULE`
    by_hand = {
        "scheduler": ["--keys", str(keys)],
        "worker": ["--model", str(model), "--keys", str(keys)],
        "draft": ["--target-model", str(model), "--keys", str(keys)],
        "gateway": ["--model", str(model), "--keys", str(keys)],
    }
    up_names = {"scheduler": "scheduler", "worker": "worker-0", "draft": "draft", "gateway": "gateway"}
    for name, service in COMPOSE_SERVICES.items():
        if name == "gpu-worker":
            continue
        by_compose = _compose_argv(name, {"SPECSERVE_MODEL": str(model)}, keys)
        hand = _resolved(service, by_hand[service])
        assert _resolved(service, by_compose) == hand, f"{name}: compose against by hand"
        assert _resolved(service, by_up[up_names[service]]) == hand, f"{name}: up against by hand"
