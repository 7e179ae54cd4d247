"""The model's tokenizer: text and chat messages to token ids, token ids to text, and the end-of-sequence ids.

A library for every process that reads a model folder (the gateway, distill, bench); its
errors are its own, and each caller maps them to its own (the gateway: a start-up failure,
an INVALID_ARGUMENT naming the client's field).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
import tokenizers

# Keys of tokenizer_config.json whose token text chat templates read (transformers passes them too).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Template variables render_chat sets itself, which a request's chat_template_kwargs may not.
RESERVED_TEMPLATE_KEYS = frozenset({"messages", "add_generation_prompt", "tools", "documents", *SPECIAL_TOKEN_KEYS})


class TokenizerLoadError(Exception):
    """A model folder's tokenizer files are missing, unreadable or malformed."""


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template rejected the conversation."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    # An assistant's calls, as OpenAI's API sends them (a JSON list's text; each call's arguments a JSON object's
    # text); "" for none. A tool's answer names the call it answers.
    tool_calls: str = ""
    tool_call_id: str = ""

    def as_template_reads(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' shape: a call's arguments as an object)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            calls = json.loads(self.tool_calls)
            for call in calls:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            message["tool_calls"] = calls
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


class Tokenizer:
    """A loaded tokenizer; build it with `Tokenizer.load(model_dir)`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: ChatTemplate | None,
        special_tokens: dict[str, Any],
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
    ) -> None:
        self._backend = backend
        self._chat_template = chat_template
        self._special_tokens = special_tokens
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size  # token ids the model accepts: 0 <= id < vocab_size

    @classmethod
    def load(cls, model_dir: Path, chat_template: Path | None = None) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json, config.json and generation_config.json, and the chat template
        from `chat_template` when given (else the folder's); raises TokenizerLoadError."""
        tokenizer_file = model_dir / "tokenizer.json"
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a bare Exception for unreadable files
            raise TokenizerLoadError(f"cannot load {tokenizer_file}: {error}") from error
        backend.no_truncation()
        backend.no_padding()
        tokenizer_config = read_json(model_dir / "tokenizer_config.json")
        model_config = read_json(model_dir / "config.json")
        generation_config = read_json(model_dir / "generation_config.json")
        special_tokens = special_token_strings(tokenizer_config)
        return cls(
            backend,
            chat_template=load_chat_template(model_dir, tokenizer_config, chat_template),
            special_tokens=special_tokens,
            eos_token_ids=eos_token_ids(backend, special_tokens, model_config, generation_config),
            vocab_size=int(model_config.get("vocab_size", backend.get_vocab_size(with_added_tokens=True))),
        )

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    # tokenizers' `encode` holds the GIL for the whole text (one call on a megabyte takes a second, and every other
    # thread of the process waits); `encode_batch` lets it go, so these use it, with the same result.

    def encode(self, text: str) -> list[int]:
        """Plain text to ids, with the special tokens the tokenizer itself adds (a BOS, for some models)."""
        ids: list[int] = self._backend.encode_batch([text], add_special_tokens=True)[0].ids
        return ids

    def encode_raw(self, text: str) -> list[int]:
        """Text to ids with no special tokens added: for text that writes its own, like part of a rendered template."""
        ids: list[int] = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (special tokens too): text of more than n times this many
        bytes cannot be n tokens, so its length can be refused before it is tokenized."""
        size = self._backend.get_vocab_size(with_added_tokens=True)
        texts = self._backend.decode_batch([[token_id] for token_id in range(size)], skip_special_tokens=False)
        return max(len(text.encode()) for text in texts)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (renders tools offered to the model)."""
        return self._chat_template is not None and "tools" in self._chat_template.variables

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat template's text for messages plus the assistant's generation prompt; `template_kwargs` are more
        variables the template reads (`enable_thinking`, say), none of the ones this passes (RESERVED_TEMPLATE_KEYS);
        `tools`, the tools offered (OpenAI's shape), for a template that takes them.

        Raises ChatTemplateError when the model has no template or the template rejects
        the conversation.
        """
        if self._chat_template is None:
            raise ChatTemplateError("the model has no chat template")
        extra = dict(template_kwargs or {})
        if reserved := sorted(RESERVED_TEMPLATE_KEYS & extra.keys()):
            raise ChatTemplateError(
                f"{', '.join(reserved)} cannot be given as template variables: the server sets them"
            )
        conversation = [message.as_template_reads() for message in messages]
        if tools:
            extra["tools"] = list(tools)
        try:
            return self._chat_template.render(
                **extra, messages=conversation, add_generation_prompt=True, **self._special_tokens
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {error}") from error

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Chat messages to ids; the template writes the special tokens, so none are added."""
        return self.encode_raw(self.render_chat(messages))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Ids to text, special tokens left out; incomplete UTF-8 at either end decodes to U+FFFD."""
        text: str = self._backend.decode(list(token_ids), skip_special_tokens=True)
        return text

    def backend_json(self) -> str:
        """The whole tokenizer as tokenizers' JSON (what a grammar engine reads to map tokens to bytes)."""
        text: str = self._backend.to_str()
        return text

    def token_text(self, token_id: int) -> str:
        """One token as text, a special token too (as log-probabilities name tokens); part of a character is U+FFFD."""
        text: str = self._backend.decode([token_id], skip_special_tokens=False)
        return text


def read_json(path: Path) -> dict[str, Any]:
    """The object in a JSON file, or {} when the file does not exist; raises TokenizerLoadError if unreadable."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TokenizerLoadError(f"cannot read {path}: {error}") from error
    if not isinstance(value, dict):
        raise TokenizerLoadError(f"{path} does not hold a JSON object")
    return value


def token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        content: str = value["content"]
        return content
    return None


def special_token_strings(tokenizer_config: dict[str, Any]) -> dict[str, Any]:
    """The template variables bos_token, eos_token, ... (and additional_special_tokens) that are set."""
    strings: dict[str, Any] = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = token_text(tokenizer_config.get(key))
        if text is not None:
            strings[key] = text
    additional = [token_text(value) for value in tokenizer_config.get("additional_special_tokens") or []]
    strings["additional_special_tokens"] = [text for text in additional if text is not None]
    return strings


def eos_token_ids(
    backend: tokenizers.Tokenizer,
    special_tokens: dict[str, Any],
    model_config: dict[str, Any],
    generation_config: dict[str, Any],
) -> tuple[int, ...]:
    """Every end-of-sequence id any of the three files names, in that order, without repeats."""
    found: list[int] = []
    for config in (generation_config, model_config):
        value = config.get("eos_token_id")
        found.extend(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    eos_text = special_tokens.get("eos_token")
    eos_id = backend.token_to_id(eos_text) if isinstance(eos_text, str) else None
    if eos_id is not None:
        found.append(eos_id)
    return tuple(dict.fromkeys(found))


def chat_template_source(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """chat_template.jinja if present, else tokenizer_config's chat_template (a string or named templates)."""
    template_file = model_dir / "chat_template.jinja"
    if template_file.exists():
        return template_file.read_text(encoding="utf-8")
    value = tokenizer_config.get("chat_template")
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def load_chat_template(
    model_dir: Path, tokenizer_config: dict[str, Any], template_file: Path | None = None
) -> ChatTemplate | None:
    """The chat template of `template_file` (a Jinja file of one's own) when given, else the folder's; None: none."""
    where = template_file or model_dir
    if template_file is None:
        source = chat_template_source(model_dir, tokenizer_config)
    else:
        try:
            source = template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise TokenizerLoadError(f"cannot read the chat template {template_file}: {error}") from error
    if source is None:
        return None
    environment = template_environment()
    try:
        variables = frozenset(jinja2.meta.find_undeclared_variables(environment.parse(source)))
        return ChatTemplate(environment.from_string(source), variables)
    except jinja2.TemplateError as error:
        raise TokenizerLoadError(f"the chat template in {where} does not compile: {error}") from error


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template, and the variables it reads from its caller (`tools`, `enable_thinking` ...)."""

    template: jinja2.Template
    variables: frozenset[str]

    def render(self, **variables: Any) -> str:
        text: str = self.template.render(**variables)
        return text


def template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """A sandbox set up the way transformers renders chat templates."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = template_tojson
    environment.globals["raise_exception"] = template_raise_exception
    environment.globals["strftime_now"] = template_strftime_now
    return environment


def template_tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def template_raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def template_strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)
