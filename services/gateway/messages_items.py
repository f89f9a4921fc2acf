"""Anthropic's Messages API, the request side: its body (pydantic), `system` and content blocks (text,
tool_use, tool_result; thinking dropped) → chat messages, its tools (`input_schema`) and `tool_choice`
→ tools.py. Torch-free, no I/O.

Chat messages in OpenAI chat's shape are the one form every API's prompt is rendered from (the
model's chat template, tools.py for the tools, calls and results), so a Messages conversation and a
chat one with the same turns make the same prompt.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt

from tandem.services.gateway.errors import APIError, bad_request
from tandem.services.gateway.protocol import SamplingFields, text_of
from tandem.services.gateway.structured import Constraint, constraints, only_one
from tandem.services.gateway.tools import ToolUse, parse_tool_use

ROLES = ("user", "assistant")


class MessagesPrompt(BaseModel):
    """What /v1/messages/count_tokens takes: the parts that make the prompt."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None   # accepted; a --reasoning-parser decides what is split


class MessagesRequest(MessagesPrompt, SamplingFields):
    max_tokens: StrictInt
    stop_sequences: list[str] | None = None
    output_config: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


def system_messages(system: str | list[Any] | None) -> list[dict]:
    if system is None:
        return []
    text = text_of(system, "system")
    return [{"role": "system", "content": text}] if text else []


def chat_messages(messages: list[Any]) -> list[dict]:
    """Anthropic's turns → chat messages: a user turn's tool_result blocks become `tool` messages (in
    block order with its text), an assistant turn's tool_use blocks its `tool_calls`."""
    if not messages:
        raise bad_request("messages: at least one message is required", "messages")
    out: list[dict] = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(f"{at}.role must be 'user' or 'assistant'", f"{at}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{at}.content must be a string or a list of content blocks", f"{at}.content")
        if m["role"] == "assistant":
            out.append(_assistant(content, at))
        else:
            out.extend(_user(content, at))
    return out


def _kind(block: Any, at: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{at} must be a content block with a `type`", at)
    return block["type"]


def _text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}.text must be a string", f"{where}.text")
    return block["text"]


def _assistant(content: list[Any], at: str) -> dict:
    texts, calls = [], []
    for j, block in enumerate(content):
        where = f"{at}.content[{j}]"
        kind = _kind(block, where)
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{where}: a tool_use block needs a string `id` and `name`", where)
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"{where}.input must be an object", f"{where}.input")
            calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": args}})
        elif kind not in ("thinking", "redacted_thinking"):   # earlier thinking is not shown again
            raise bad_request(f"{where}: an assistant turn holds text, tool_use and thinking blocks, not {kind!r}",
                              f"{where}.type")
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(content: list[Any], at: str) -> list[dict]:
    out: list[dict] = []
    for j, block in enumerate(content):
        where = f"{at}.content[{j}]"
        kind = _kind(block, where)
        if kind == "text":
            text = _text(block, where)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
            result = text_of(block.get("content", ""), f"{where}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise bad_request(f"{where}: only text and tool_result blocks are supported in a user turn, not "
                              f"{kind!r}", f"{where}.type")
    if not out:
        raise bad_request(f"{at}.content must not be empty", f"{at}.content")
    return out


def tool_use(req: MessagesPrompt) -> ToolUse | None:
    """`tools` ({name, description, input_schema}) and `tool_choice` ({"type": auto | any | tool | none})
    as tools.py checks them; a server tool (bash, web search, ...) is a 400."""
    chat_tools = None
    if req.tools is not None:
        chat_tools = []
        for i, t in enumerate(req.tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom" or "input_schema" not in t:
                raise bad_request(f"tools[{i}]: only client tools ({{name, description, input_schema}}) are "
                                  "supported", f"tools[{i}]")
            fn = {"name": t.get("name"), "parameters": t["input_schema"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            chat_tools.append({"type": "function", "function": fn})
    choice, parallel = _choice(req.tool_choice)
    try:
        return parse_tool_use(chat_tools, choice, parallel)
    except APIError as e:   # Anthropic's names: tools[i].function.parameters → tools[i].input_schema
        def renamed(text: str) -> str:
            return text.replace(".function.parameters", ".input_schema").replace(".function.", ".")

        raise APIError(e.status, renamed(e.message), e.param and renamed(e.param), e.code) from None


def _choice(tc: dict[str, Any] | None) -> tuple[Any, bool | None]:
    if tc is None:
        return None, None
    kind = tc.get("type")
    parallel = None if tc.get("disable_parallel_tool_use") is None else not tc["disable_parallel_tool_use"]
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name")}}, parallel
    raise bad_request("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", "tool_choice.type")


def output_format(req: MessagesRequest, tools: ToolUse | None) -> Constraint | None:
    """`output_config.format` ({"type": "json_schema", "schema": {...}}) as structured.py's
    json_schema, judged the same way; with tools that force a call, two constraints are a 400."""
    found: list[Constraint] = []
    fmt = (req.output_config or {}).get("format")
    if fmt is not None:
        at = "output_config.format"
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
            raise bad_request(f"{at} must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", at)
        try:
            (c,) = constraints({"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}, None, {})
        except APIError as e:
            old = "response_format.json_schema"
            raise APIError(e.status, e.message.replace(old, at), e.param and e.param.replace(old, at)) from None
        found.append(Constraint(c.structured, f"{at}.schema"))
    if tools is not None and (c := tools.constraint()) is not None:
        found.append(c)
    return only_one(found)
