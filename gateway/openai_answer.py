"""An OpenAI answer being made: each choice's request and what it has given (`Choice`), and how the answer looks,
whole and streamed (`Shape`): text or chat messages, a thinking model's reasoning apart, tool calls read, usage."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gateway.choices import Copy
from gateway.openai_logprobs import CompletionLogprobs, Scored, TokenTexts, chat_logprobs
from gateway.output import Chunk
from gateway.output_formats import ReasoningParser, ToolCallParser
from gateway.reasoning import ReasoningSplitter, Split, split_whole
from gateway.request import Submission
from gateway.tools import CallGate, ToolAsk, parse_calls


def best_choices(choices: list[Choice], n: int) -> list[Choice]:
    """Of each prompt's copies, the n with the highest log-probability per token (OpenAI's best_of), best first;
    all of them, in order, when there are only n."""
    chosen: list[Choice] = []
    for prompt_index in sorted({choice.prompt_index for choice in choices}):
        copies = [choice for choice in choices if choice.prompt_index == prompt_index]
        if len(copies) > n:
            copies = sorted(copies, key=lambda choice: -choice.mean_logprob)[:n]
            for rank, choice in enumerate(copies):
                choice.index = prompt_index * n + rank
        chosen += copies
    return chosen


class Choice:
    """One choice of an answer: its request, and what it has given so far.

    A prompt's copies (n or best_of of them, gateway/choices.py) start once its first copy's
    prompt is computed (`lead`); an echoed prompt's log-probabilities are the first copy's.
    """

    def __init__(
        self,
        index: int,
        prompt_index: int,
        submission: Submission,
        logprobs: bool,
        texts: TokenTexts,
        *,
        echo: str | None,
        lead: Choice | None,
    ) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.submission = submission
        self.logprobs = logprobs  # the client asked for the completion's log-probabilities
        self.echo = echo  # the prompt's text, when the answer starts with it
        self.texts = texts
        self.lead = lead
        self.copy: Copy = Copy(submission, lead.copy if lead is not None else None)
        self.completion_logprobs = CompletionLogprobs(texts)
        self.text: list[str] = []
        self.prompt_scored: list[Scored] = []  # the prompt's log-probabilities as they came
        self.completion_scored: list[Scored] = []
        self.echoed = echo is None  # the echo has been streamed (or there is none)
        self.last: Chunk | None = None
        self.splitter: ReasoningSplitter | None = None  # a streamed chat answer's, with a reasoning parser
        self.gate: CallGate | None = None  # a streamed chat answer's, with tools offered

    @property
    def echoed_scores(self) -> list[Scored]:
        """The echoed prompt's log-probabilities: its own, or its first copy's."""
        return self.prompt_scored if self.prompt_scored or self.lead is None else self.lead.prompt_scored

    @property
    def mean_logprob(self) -> float:
        values = [entry.logprob for _, entry in self.completion_scored if entry is not None]
        return sum(values) / len(values) if values else 0.0

    def take(self, chunk: Chunk) -> None:
        """A whole answer's chunk."""
        self.text.append(chunk.text)
        if chunk.prompt_logprobs:
            self.prompt_scored.extend(chunk.prompt_logprobs)
        if chunk.logprobs is not None:
            self.completion_scored.extend(zip(chunk.token_ids, chunk.logprobs))
        if chunk.finish_reason is not None:
            self.last = chunk

    def logprobs_object(self, entries: Sequence[Scored], chat: bool) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return chat_logprobs(entries, self.texts) if chat else self.completion_logprobs.add(entries)


class Shape:
    """How OpenAI's responses look for one request."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        reasoning: ReasoningParser | None = None,
        tools: tuple[ToolAsk, ToolCallParser] | None = None,
    ) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        self.reasoning = reasoning  # a chat answer's reasoning goes to reasoning_content
        self.tools = tools  # the tools offered, and the format calls are read in
        self.created = int(time.time())

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole chat answer's message (its reasoning apart, its tool calls read) and its finish reason ("tool_calls"
        where it called)."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            split = split_whole(self.reasoning, text)
            message.update(content=split.content, reasoning_content=split.reasoning)
        if self.tools is not None:
            content, calls = parse_calls(self.tools[1], message["content"] or "", self.tools[0])
            if calls:
                message.update(content=content, tool_calls=[call.as_openai() for call in calls])
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return message, finish_reason

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, chosen: list[Choice], every: list[Choice]) -> dict[str, Any]:
        """The answer of the chosen choices, in index order; usage counts every one that ran."""
        answers: list[dict[str, Any]] = []
        for choice in sorted(chosen, key=lambda c: c.index):
            assert choice.last is not None  # every generation ends with a finishing chunk
            text = "".join(choice.text)
            entries = choice.completion_scored
            if choice.echo is not None:
                if choice.logprobs:
                    entries = choice.echoed_scores + entries
                else:
                    choice.completion_logprobs.skip(choice.echo)
                text = choice.echo + text
            logprobs = choice.logprobs_object(entries, self.chat)
            if self.chat:
                message, finish_reason = self.message(text, choice.last.finish_reason)
                answers.append(
                    {"index": choice.index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
                )
            else:
                answers.append(
                    {
                        "index": choice.index,
                        "text": text,
                        "finish_reason": choice.last.finish_reason,
                        "logprobs": logprobs,
                    }
                )
        return {
            **self._envelope("chat.completion" if self.chat else "text_completion"),
            "choices": answers,
            "usage": usage(every),
        }

    def delta_event(
        self, index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {
            **self._envelope("chat.completion.chunk"),
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}],
        }

    def stream_events(self, choice: Choice, chunk: Chunk) -> list[dict[str, Any]]:
        """The events one chunk of a choice makes: none while an echoed prompt's log-probabilities still come in, then
        the echo, then the chunk's text."""
        if chunk.finish_reason is not None:
            choice.last = chunk
        events: list[dict[str, Any]] = []
        if chunk.prompt_logprobs:
            choice.prompt_scored.extend(chunk.prompt_logprobs)
        if not choice.echoed:
            if not chunk.token_ids and chunk.finish_reason is None and not chunk.text:
                return events  # more of the prompt's log-probabilities to come
            assert choice.echo is not None
            if not choice.logprobs:
                choice.completion_logprobs.skip(choice.echo)
            events.append(
                self._text_event(choice, choice.echo, None, choice.logprobs_object(choice.echoed_scores, False))
            )
            choice.echoed = True
        if not chunk.text and not chunk.token_ids and chunk.finish_reason is None:
            return events
        entries = list(zip(chunk.token_ids, chunk.logprobs)) if chunk.logprobs is not None else []
        logprobs = choice.logprobs_object(entries, self.chat)
        if self.chat and self.tools is not None and self.reasoning is None:
            # Text streams as content until a call may begin; each call goes out once it is known (CallGate).
            if choice.gate is None:
                choice.gate = CallGate(self.tools[1], self.tools[0])
            first_call = choice.gate.num_calls
            content, calls = choice.gate.feed(chunk.text)
            if chunk.finish_reason is not None:
                rest, last_calls = choice.gate.finish()
                content, calls = content + rest, calls + last_calls
            if content or logprobs is not None:
                events.append(self.delta_event(choice.index, {"content": content} if content else {}, None, logprobs))
            for index, call in enumerate(calls, start=first_call):
                # As OpenAI's stream: the call's id and name with empty arguments, then its arguments.
                opening = call.as_openai(index)
                arguments = opening["function"]["arguments"]
                opening["function"]["arguments"] = ""
                events.append(self.delta_event(choice.index, {"tool_calls": [opening]}, None, None))
                events.append(
                    self.delta_event(
                        choice.index,
                        {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]},
                        None,
                        None,
                    )
                )
            if chunk.finish_reason is not None:
                finish_reason = (
                    "tool_calls" if choice.gate.num_calls and chunk.finish_reason == "stop" else chunk.finish_reason
                )
                events.append(self.delta_event(choice.index, {}, finish_reason, None))
        elif self.chat and self.tools is not None:
            # With a reasoning parser too, the answer is read whole at its end (its reasoning, then its calls).
            choice.text.append(chunk.text)
            if chunk.finish_reason is None:
                if logprobs is not None:
                    events.append(self.delta_event(choice.index, {}, None, logprobs))
                return events
            message, finish = self.message("".join(choice.text), chunk.finish_reason)
            whole = {key: value for key, value in message.items() if key != "role" and value is not None}
            if "tool_calls" in whole:
                whole["tool_calls"] = [{"index": index, **call} for index, call in enumerate(whole["tool_calls"])]
            events.append(self.delta_event(choice.index, whole, finish, logprobs))
        elif self.chat:
            events.append(
                self.delta_event(choice.index, self._chat_delta(choice, chunk), chunk.finish_reason, logprobs)
            )
        else:
            events.append(self._text_event(choice, chunk.text, chunk.finish_reason, logprobs))
        return events

    def _chat_delta(self, choice: Choice, chunk: Chunk) -> dict[str, Any]:
        """A chat chunk's delta: its text as content, or with a reasoning parser, as reasoning and content (a piece
        that may begin a tag held back until the next chunk, or the last, says)."""
        if self.reasoning is None:
            return {"content": chunk.text} if chunk.text else {}
        if choice.splitter is None:
            choice.splitter = ReasoningSplitter(self.reasoning)
        split = Split()
        split.add(*choice.splitter.feed(chunk.text))
        if chunk.finish_reason is not None:
            split.add(*choice.splitter.finish())
        delta = {"reasoning_content": split.reasoning} if split.reasoning is not None else {}
        return delta | ({"content": split.content} if split.content is not None else {})

    def _text_event(
        self, choice: Choice, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {
            **self._envelope("text_completion"),
            "choices": [{"index": choice.index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
        }

    def usage_event(self, choices: list[Choice]) -> dict[str, Any]:
        return {
            **self._envelope("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [],
            "usage": usage(choices),
        }


def usage(choices: list[Choice]) -> dict[str, Any]:
    """Each prompt counted once, however many copies ran
    (its cached tokens too: what the first copy found cached); every
    completion token generated."""
    lasts = [choice.last for choice in choices if choice.last is not None]
    leads = [choice.last for choice in choices if choice.lead is None and choice.last is not None]
    prompt = sum(last.num_prompt_tokens for last in leads)
    completion = sum(last.num_completion_tokens for last in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(last.num_cached_tokens for last in leads)},
        "speculation": {
            "draft_tokens": sum(last.speculation.num_draft_tokens for last in lasts),
            "accepted_draft_tokens": sum(last.speculation.num_accepted_draft_tokens for last in lasts),
            "verify_steps": sum(last.speculation.num_verify_steps for last in lasts),
        },
    }
