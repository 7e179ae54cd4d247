"""The gRPC API's side of a request: a GenerateRequest to a ClientRequest, and the message's field names for errors."""

from __future__ import annotations

import json

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from gateway.errors import InvalidArgument
from gateway.request import ChatPrompt, ClientRequest, Prompt, Submission, TextPrompt, TokenPrompt
from gateway.structured_request import SpecError, parsed_schema
from gateway.validation import FieldNames, Grammars, checked_request_id, validate
from common.text.structured import StructuredSpec
from common.text.tokenizer import ChatMessage
from proto import specserve_pb2 as pb

GRPC_FIELDS = FieldNames(
    text_prompt="prompt",
    chat="chat",
    chat_messages="chat.messages",
    chat_role="chat.messages[{index}].role",
    token_ids="token_ids.ids",
    token_id="token_ids.ids[{index}]",
    max_tokens="params.max_tokens",
    temperature="params.temperature",
    top_p="params.top_p",
    top_k="params.top_k",
    min_p="params.min_p",
    seed="params.seed",
    stop_strings="params.stop",
    stop_string="params.stop[{index}]",
    stop_token_id="params.stop_token_ids[{index}]",
    logprobs="params.logprobs",
    prompt_logprobs="params.prompt_logprobs",
    presence_penalty="params.presence_penalty",
    frequency_penalty="params.frequency_penalty",
    repetition_penalty="params.repetition_penalty",
    logit_bias="params.logit_bias",
    min_tokens="params.min_tokens",
)


def request_id_of(request: pb.GenerateRequest, generated_id: str) -> str:
    """The client's request_id when it set one (checked), else generated_id."""
    if not request.HasField("request_id"):
        return generated_id
    return checked_request_id(request.request_id, field="request_id")


def submission_of(
    request: pb.GenerateRequest, *, request_id: str, vocab_size: int, grammars: Grammars | None = None
) -> Submission:
    """Every field of the request checked; raises InvalidArgument naming the first bad one as the message does."""
    refuse_unknown_fields(request)
    return validate(
        client_request_of(request), fields=GRPC_FIELDS, request_id=request_id, vocab_size=vocab_size, grammars=grammars
    )


def refuse_unknown_fields(message: Message) -> None:
    """Raises InvalidArgument naming the first field the message carries that this server's schema lacks."""
    if unknown := unknown_field(message):
        raise InvalidArgument(
            unknown,
            "is a field this server does not know (a client built from a newer "
            "specserve.proto?): it would be ignored, so the request is refused",
        )


def unknown_field(message: Message, path: str = "") -> str:
    """The first field the message (or a message in it) carries that this server's schema does not define, as
    `path.#number`; "" when there is none. Protobuf keeps such fields aside, where nothing reads them."""
    for field in UnknownFieldSet(message):
        return f"{path}#{field.field_number}"
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None or descriptor.message_type.GetOptions().map_entry:
            continue
        name = f"{path}{descriptor.name}"
        items = (
            [(f"{name}.", value)] if isinstance(value, Message) else [(f"{name}[{i}].", v) for i, v in enumerate(value)]
        )
        for at, item in items:
            if found := unknown_field(item, at):
                return found
    return ""


def client_request_of(request: pb.GenerateRequest) -> ClientRequest:
    """The message's fields, unset ones as None; raises InvalidArgument when it sets no input."""
    params = request.params
    return ClientRequest(
        prompt=prompt_of(request),
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        temperature=params.temperature if params.HasField("temperature") else None,
        top_p=params.top_p if params.HasField("top_p") else None,
        top_k=params.top_k if params.HasField("top_k") else None,
        min_p=params.min_p if params.HasField("min_p") else None,
        seed=params.seed if params.HasField("seed") else None,
        stop_strings=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
        presence_penalty=params.presence_penalty if params.HasField("presence_penalty") else None,
        frequency_penalty=params.frequency_penalty if params.HasField("frequency_penalty") else None,
        repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else None,
        logit_bias=tuple(sorted(params.logit_bias.items())),
        min_tokens=params.min_tokens if params.HasField("min_tokens") else None,
        structured=structured_of(params),
        cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
        priority=request.priority if request.HasField("priority") else None,
    )


def structured_of(params: pb.SamplingParams) -> tuple[str, StructuredSpec] | None:
    if not params.HasField("structured_output"):
        return None
    output = params.structured_output
    kind = output.WhichOneof("kind")
    field = f"params.structured_output.{kind}"
    match kind:
        case None:
            raise InvalidArgument(
                "params.structured_output", "set one of json_object, json_schema, regex, choice, grammar"
            )
        case "json_object":
            return (field, StructuredSpec("json_object")) if output.json_object else None
        case "json_schema":
            try:
                schema = parsed_schema(field, output.json_schema)
            except SpecError as error:
                raise InvalidArgument(field, str(error)) from error
            return field, StructuredSpec("json_schema", json.dumps(schema, sort_keys=True))
        case "choice":
            if not output.choice.choices or not all(output.choice.choices):
                raise InvalidArgument(field, "must hold at least one choice, none empty")
            return field, StructuredSpec("choice", json.dumps(list(output.choice.choices)))
        case _:
            return field, StructuredSpec("regex" if kind == "regex" else "grammar", getattr(output, kind))


def prompt_of(request: pb.GenerateRequest | pb.TokenizeRequest) -> Prompt:
    """The oneof `input`, whichever member is set (an empty one too: `validate` names it)."""
    if request.HasField("prompt"):
        return TextPrompt(request.prompt)
    if request.HasField("chat"):
        return ChatPrompt(
            tuple(ChatMessage(role=message.role, content=message.content) for message in request.chat.messages)
        )
    if isinstance(request, pb.GenerateRequest) and request.HasField("token_ids"):
        return TokenPrompt(tuple(request.token_ids.ids))
    raise InvalidArgument(
        "input",
        "set one of prompt, chat or token_ids" if isinstance(request, pb.GenerateRequest) else "set prompt or chat",
    )
