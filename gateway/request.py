"""A generation request in neither public API's terms:
as the client sent it (ClientRequest) and once checked (Submission).

Each front end (gRPC in grpc_request.py, HTTP in openai_request.py and sglang_request.py) turns its wire
request into a ClientRequest, checking only what its own format can get wrong (a missing field, a
string where a number belongs); `validation.validate` checks the values once for both.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from common.text.structured import StructuredSpec
from common.text.tokenizer import ChatMessage
from proto import messages


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class ChatPrompt:
    messages: tuple[ChatMessage, ...]
    template_kwargs: str = ""  # more variables for the chat template, as a JSON object's text ("": none)
    tools: str = ""  # the tools offered, OpenAI's shape, as a JSON list's text ("": none), for the template


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: tuple[int, ...]


Prompt = TextPrompt | ChatPrompt | TokenPrompt


@dataclass(frozen=True)
class ClientRequest:
    """What the client asked for, typed but not yet checked; None: the client left the field unset."""

    prompt: Prompt
    max_tokens: int | None = None  # None: until a stop condition or the context is full
    temperature: float | None = None  # None: greedy
    top_p: float | None = None  # None: 1
    top_k: int | None = None  # None: no top-k cut
    min_p: float | None = None  # None: no min-p cut
    seed: int | None = None  # None: the scheduler draws one
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # eos not included
    ignore_eos: bool = False
    # Log-probabilities with this many alternatives: of each completion token, and of the prompt's tokens (with them
    # asked, max_tokens may be 0). None: none.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Penalties (modeling/sampling/penalties.py); None: none.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int | None = None
    structured: tuple[str, StructuredSpec] | None = None  # what the output must follow, and the field that asked
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache pages (vLLM's cache_salt)
    priority: int | None = None  # lower first under the scheduler's --scheduling-policy priority; None: 0
    user: str | None = None  # OpenAI's end-user id: whose text drafts are drawn from, where no API key says


@dataclass(frozen=True)
class Submission:
    """A request that passed every check; only tokenization is left before it goes to the scheduler."""

    request_id: str
    prompt: Prompt
    prompt_field: str  # the client's name for the prompt, for errors found when tokenizing it
    max_tokens: int | None  # None: until a stop condition or the context is full
    sampling: messages.SamplingParams
    seed_given: bool  # False: sampling.seed is 0 and the scheduler draws one
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]  # the client's own, eos not included
    ignore_eos: bool
    logprobs: int | None = None  # alternatives with each completion token's log-probability; None: none
    prompt_logprobs: int | None = None  # alternatives with each prompt token's; None: none
    grammar: str | None = None  # the grammar the completion follows (checked); None: any text
    cache_salt: str | None = None  # the client's (checked); None: none given
    priority: int = 0  # lower first under the scheduler's --scheduling-policy priority
    tenant: str | None = None  # the tenant of the API key it came with (gateway/access.py); None: no keys required
    user: str | None = None  # the client's end-user id (OpenAI's `user`), where it sent one
    # A salt of this request alone, which its copies (n, best_of) keep: where the cache is not shared by default
    # (--prefix-cache-scope salt), what an unsalted request's pages are shared under.
    own_salt: str = field(default_factory=lambda: uuid.uuid4().hex)

    def to_submit_request(
        self, prompt_token_ids: list[int], eos_token_ids: Sequence[int], cache_salt: str = ""
    ) -> messages.SubmitRequest:
        """The scheduler's message: eos ids stop the request unless ignore_eos, then the client's stop ids (which
        min_tokens holds back); `cache_salt` is the salt its prefix-cache pages are keyed under
        (gateway/cache_scope.py)."""
        # A grammar says when end-of-sequence may come: then it ends the output, ignore_eos or not.
        stop_ids = [] if self.ignore_eos and self.grammar is None else list(eos_token_ids)
        stop_token_ids = list(dict.fromkeys([*stop_ids, *self.stop_token_ids]))
        sampling = self.sampling
        if sampling.penalties is not None and sampling.penalties.min_tokens:
            sampling = msgspec.structs.replace(
                sampling, penalties=msgspec.structs.replace(sampling.penalties, stop_token_ids=stop_token_ids)
            )
        return messages.SubmitRequest(
            request_id=self.request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=self.max_tokens,
            sampling=sampling,
            stop_token_ids=stop_token_ids,
            seed_given=self.seed_given,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            grammar=self.grammar,
            cache_salt=cache_salt,
            priority=self.priority,
            tenant=drafting_tenant(self.tenant, self.user),
        )


def drafting_tenant(key_tenant: str | None, user: str | None) -> str:
    """Whose text a draft that learns from traffic may draft from for this request, and whose its text becomes: the
    API key's tenant where keys are required (a user id cannot cross keys); else the client's `user`, as a digest (a
    claim: any caller may send any user id); else "", the one tenant of callers nothing tells apart."""
    if key_tenant is not None:
        return f"key:{key_tenant}"
    if user:
        return "user:" + hashlib.sha256(b"specserve user " + user.encode()).hexdigest()[:16]
    return ""
