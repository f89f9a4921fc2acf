"""OpenAI response bodies and stream chunks, built from the router's GenerateResponse messages."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.services.gateway.reasoning import ReasoningParser, split_reasoning
from tandem.services.gateway.tokenizer import GatewayTokenizer
from tandem.services.gateway.tool_parser import read_whole
from tandem.v1 import generation_pb2

FINISH_REASONS = {
    generation_pb2.FINISH_REASON_UNSPECIFIED: None,
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}
_PREFIX = "FINISH_REASON_"


def finish_reason(value: int) -> str | None:
    """The OpenAI spelling of a finish reason. One this gateway has no entry for (a newer engine's)
    passes as its own name in lower case (FINISH_REASON_X → "x"), never as "stop": a client must not
    take an output that something else ended for a complete one."""
    if value in FINISH_REASONS:
        return FINISH_REASONS[value]
    try:
        name = generation_pb2.FinishReason.Name(value)
    except ValueError:
        return f"unknown_{value}"
    return name.removeprefix(_PREFIX).lower()


# JSON has no -inf; a token the sampler could never pick is reported with this logprob.
_MIN_LOGPROB = -9999.0


def _lp(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def stop_reason(msg: generation_pb2.GenerateResponse) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or stop_token_ids entry that ended the output, else None."""
    which = msg.WhichOneof("stop_reason")
    return None if which is None else getattr(msg, which)


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class Choice:
    """One choice's output so far (non-streaming responses accumulate into it)."""

    index: int
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    usage: generation_pb2.Usage | None = None

    def add(self, msg: generation_pb2.GenerateResponse) -> None:
        self.text.append(msg.text)
        self.num_tokens += len(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        self.observe(msg)

    def track(self, msg: generation_pb2.GenerateResponse) -> None:
        """Count a streamed chunk without keeping its text (streaming sends the text on)."""
        self.num_tokens += len(msg.token_ids)
        self.observe(msg)

    def observe(self, msg: generation_pb2.GenerateResponse) -> None:
        if msg.finish_reason:
            self.finish_reason = finish_reason(msg.finish_reason)
            self.matched_stop = stop_reason(msg)
        if msg.HasField("usage"):
            self.usage = msg.usage

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else self.num_tokens


def usage(choices: list[Choice], n: int) -> dict:
    """Prompt tokens count once per prompt (choice i*n of each prompt), completion tokens per choice."""
    firsts = [c for c in choices if c.index % n == 0]
    prompt = sum(c.usage.prompt_tokens if c.usage is not None and c.usage.prompt_tokens else c.prompt_tokens
                 for c in firsts)
    cached = sum(c.usage.cached_tokens for c in firsts if c.usage is not None)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class CompletionFormat:
    """/v1/completions: `text_completion` objects; logprobs in the legacy (tokens, token_logprobs) shape."""

    object = "text_completion"

    def __init__(self, rid: str, created: int, model: str, tokenizer: GatewayTokenizer, logprobs: int | None):
        self.rid, self.created, self.model = rid, created, model
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self._offsets: dict[int, int] = {}

    def _head(self) -> dict:
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model}

    def _logprobs(self, index: int, lps) -> dict | None:
        if self.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        for lp in lps:
            text = self.tokenizer.token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(_lp(lp.logprob))
            tops.append({self.tokenizer.token_text(t.token_id): _lp(t.logprob) for t in lp.top} if self.logprobs else None)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chunk(self, index: int, msg: generation_pb2.GenerateResponse, include_usage: bool) -> dict:
        choice = {"index": index, "text": msg.text, "logprobs": self._logprobs(index, msg.logprobs),
                  "finish_reason": finish_reason(msg.finish_reason)}
        if msg.finish_reason:
            choice["stop_reason"] = stop_reason(msg)
        out = {**self._head(), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self._head(), "choices": [], "usage": usage_}

    def response(self, choices: list[Choice], n: int) -> dict:
        return {**self._head(), "choices": [
            {"index": c.index, "text": "".join(c.text), "logprobs": self._logprobs(c.index, c.logprobs),
             "finish_reason": c.finish_reason, "stop_reason": c.matched_stop}
            for c in choices], "usage": usage(choices, n), "system_fingerprint": None}


class ChatFormat(CompletionFormat):
    """/v1/chat/completions: `chat.completion(.chunk)` objects; logprobs as `content` entries.
    `tool_parser`: makes the parser the output is read for tool calls with (tool_formats.parser_for; None:
    no tools); a choice that made any and stopped by itself finishes with "tool_calls". `reasoning`: the parser (reasoning.py) that splits the
    model's thinking (`reasoning_content`) from its answer, which alone is read for tool calls."""

    object = "chat.completion"

    def __init__(self, rid: str, created: int, model: str, tokenizer: GatewayTokenizer, logprobs: bool,
                 tool_parser: Callable[[], Any] | None = None, reasoning: str | None = None):
        super().__init__(rid, created, model, tokenizer, None)
        self.chat_logprobs = logprobs
        self.tool_parser = tool_parser
        self.reasoning = reasoning
        self._started: set[int] = set()
        self._parsers: dict[int, Any] = {}
        self._thinking: dict[int, ReasoningParser] = {}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.tokenizer.token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

    def _chat_logprobs(self, lps) -> dict | None:
        if not self.chat_logprobs:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t.token_id, t.logprob) for t in lp.top]} for lp in lps],
                "refusal": None}

    def chunk(self, index: int, msg: generation_pb2.GenerateResponse, include_usage: bool) -> dict | None:
        """One stream chunk, or None when there is nothing to send yet (text held back by the tool parser)."""
        text, thought = msg.text, ""
        if self.reasoning:
            thinking = self._thinking.setdefault(index, ReasoningParser(self.reasoning))
            split = thinking.feed(msg.text)
            if msg.finish_reason:
                split += thinking.finish()
            text, thought = split.content, split.reasoning
        delta: dict = {"content": text} if text or not self.reasoning else {}
        reason = finish_reason(msg.finish_reason)
        if self.tool_parser:
            parser = self._parsers.get(index) or self._parsers.setdefault(index, self.tool_parser())
            d = parser.feed(text)
            if msg.finish_reason:
                end = parser.finish()
                d.content += end.content
                d.calls += end.calls
                reason = _with_calls(reason, bool(parser.calls))
            delta = {"content": d.content} if d.content else {}
            if d.calls:
                delta["tool_calls"] = d.calls
        if thought:
            delta = {"reasoning_content": thought, **delta}
        if (self.tool_parser or self.reasoning) and not delta and not msg.finish_reason and not msg.logprobs \
                and index in self._started:
            return None
        if index not in self._started:  # the first chunk of a choice carries its role
            self._started.add(index)
            delta = {"role": "assistant", **delta} if delta else {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": self._chat_logprobs(msg.logprobs),
                  "finish_reason": reason}
        if msg.finish_reason:
            choice["stop_reason"] = stop_reason(msg)
        out = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage_: dict) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": [], "usage": usage_}

    def response(self, choices: list[Choice], n: int) -> dict:
        return {**self._head(), "system_fingerprint": None, "choices": [self._choice(c) for c in choices],
                "usage": usage(choices, n)}

    def _choice(self, c: Choice) -> dict:
        text = "".join(c.text)
        thought = None
        if self.reasoning:
            split = split_reasoning(self.reasoning, text)
            text, thought = split.content, split.reasoning or None
        message: dict = {"role": "assistant", "content": text if text or thought is None else None}
        reason = c.finish_reason
        if self.tool_parser:
            content, calls = read_whole(self.tool_parser(), text)
            if calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": [call.message() for call in calls]}
                reason = _with_calls(reason, True)
        if self.reasoning:
            message["reasoning_content"] = thought
        return {"index": c.index, "message": message, "logprobs": self._chat_logprobs(c.logprobs),
                "finish_reason": reason, "stop_reason": c.matched_stop}


def _with_calls(reason: str | None, called: bool) -> str | None:
    # OpenAI's "tool_calls" says the model stopped to have its calls run; one cut short keeps "length".
    return "tool_calls" if called and reason == "stop" else reason


class OpenAIChunks:
    """A chat or completion format as the pipeline's `Format`: `data:` chunks, the usage chunk when
    asked for, `data: [DONE]`; an error after the first chunk is an `error` chunk before `[DONE]`."""

    def __init__(self, fmt: CompletionFormat):
        self.fmt = fmt

    def response(self, choices: list[Choice], n: int) -> dict:
        return self.fmt.response(choices, n)

    def start(self) -> list[bytes]:
        return []

    def chunk(self, index: int, msg: generation_pb2.GenerateResponse, include_usage: bool) -> list[bytes]:
        out = self.fmt.chunk(index, msg, include_usage)
        return [] if out is None else [sse(out)]

    def end(self, choices: list[Choice], totals: dict, include_usage: bool) -> list[bytes]:
        return [sse(self.fmt.usage_chunk(totals)), SSE_DONE] if include_usage else [SSE_DONE]

    def stream_error(self, err) -> list[bytes]:
        return [sse(err.body()), SSE_DONE]


def sse_event(obj: dict) -> bytes:
    """An SSE frame named by the payload's `type` (the Responses and Messages APIs' streams)."""
    return b"event: " + obj["type"].encode() + b"\n" + sse(obj)
