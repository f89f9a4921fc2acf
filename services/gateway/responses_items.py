"""The Responses API's request side: its body (pydantic), input items → chat messages, its flat
function tools and `text.format` → the chat side's tools.py / structured.py, and the output blocks →
the chat messages a follow-up (`previous_response_id`) continues from. Torch-free, no I/O.

A conversation is kept as chat messages (OpenAI chat's shape: assistant `tool_calls`, `tool` results
with their `tool_call_id`), so every turn's prompt is rendered by the same chat template path as
/v1/chat/completions, and a follow-up's prompt starts with the tokens of the turns before it (the
prefix cache and cache-aware routing reuse their KV).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

from pydantic import StrictBool

from tandem.services.gateway.blocks import Block
from tandem.services.gateway.errors import APIError, bad_request
from tandem.services.gateway.protocol import SamplingFields, text_of
from tandem.services.gateway.structured import Constraint, constraints, only_one
from tandem.services.gateway.tools import ToolUse, parse_tool_use

# Message roles an input item may have, and the content part types read as text.
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(SamplingFields):
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    store: StrictBool = True
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    text: Any = None
    metadata: dict[str, str] | None = None
    reasoning: Any = None        # effort / summary: accepted; a --reasoning-parser decides what is split
    background: bool = False
    conversation: Any = None
    truncation: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def check_request(req: ResponsesRequest) -> None:
    if req.background:
        raise bad_request("background responses are not supported", "background")
    if req.conversation is not None:
        raise bad_request("conversation is not supported; use previous_response_id", "conversation")
    if req.truncation not in (None, "disabled"):
        raise bad_request("truncation must be 'disabled' (prompts are never cut)", "truncation")
    if isinstance(req.input, str) and not req.input:
        raise bad_request("input must not be empty", "input")
    if isinstance(req.input, list) and not req.input:
        raise bad_request("input must be a non-empty list of items", "input")


# ---- tools and text.format ------------------------------------------------------------------------

def tool_use(req: ResponsesRequest) -> ToolUse | None:
    """The Responses API's flat function tools ({"type": "function", "name", "parameters"}) checked by
    the chat side's tools.py; other tool types (web search, file search, ...) are a 400."""
    tools = req.tools
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be a list of function tools", "tools")
        chat_tools = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise bad_request(f"tools[{i}]: only function tools are supported, got type {kind!r}",
                                  f"tools[{i}].type")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            chat_tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                              "\"name\": ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        return parse_tool_use(chat_tools, choice, req.parallel_tool_calls)
    except APIError as e:   # the Responses API's names: tools[i].function.x → tools[i].x
        raise _renamed(e, ".function.", ".") from None


def text_format(req: ResponsesRequest, tools: ToolUse | None) -> Constraint | None:
    """`text.format` ({"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}) as
    structured.py's response_format, so it is judged and named the same way."""
    text = req.text
    found: list[Constraint] = []
    if text is not None:
        if not isinstance(text, dict):
            raise bad_request("text must be an object", "text")
        fmt = text.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict):
                raise bad_request("text.format must be an object", "text.format")
            rf: dict[str, Any] = {"type": fmt.get("type", "text")}
            if rf["type"] == "json_schema":
                if "schema" not in fmt:
                    raise bad_request("text.format.schema is required", "text.format.schema")
                rf["json_schema"] = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
            try:
                found = [replace(c, param=_field(c.param)) for c in constraints(rf, None, {})]
            except APIError as e:
                raise _renamed(_renamed(e, "response_format.json_schema.", "text.format."),
                               "response_format", "text.format") from None
    if tools is not None and (c := tools.constraint()) is not None:
        found.append(c)
    return only_one(found)


def _field(param: str) -> str:
    return param.replace("response_format.json_schema.", "text.format.").replace("response_format", "text.format")


def _renamed(err: APIError, old: str, new: str) -> APIError:
    return APIError(err.status, err.message.replace(old, new), err.param and err.param.replace(old, new), err.code)


def format_echo(req: ResponsesRequest) -> dict:
    """The response's `text` field: the request's format, or plain text."""
    fmt = req.text.get("format") if isinstance(req.text, dict) else None
    return {"format": fmt if isinstance(fmt, dict) else {"type": "text"}}


# ---- input items → chat messages ------------------------------------------------------------------

def _text_of(content: Any, at: str) -> str:
    return text_of(content, at, TEXT_PARTS)


def _str(item: dict, key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{at}.{key} must be a non-empty string", f"{at}.{key}")
    return value


def input_messages(value: str | list[Any]) -> tuple[list[dict], list[dict]]:
    """The request's `input` → (chat messages, the input items as the API lists them back, with ids)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    messages: list[dict] = []
    items: list[dict] = []
    for i, item in enumerate(value):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{at} must be an object (an input item)", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{at}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{at}.role")
            text = _text_of(item.get("content"), f"{at}.content")
            messages.append({"role": role, "content": text})
            part = "output_text" if role == "assistant" else "input_text"
            items.append({"type": "message", "id": item.get("id") or new_id("msg"), "role": role, "status": "completed",
                          "content": [{"type": part, "text": text}]})
        elif kind == "function_call":
            call_id, name = _str(item, "call_id", at), _str(item, "name", at)
            args = item.get("arguments", "{}")
            try:
                parsed = json.loads(args) if isinstance(args, str) and args.strip() else {}
            except json.JSONDecodeError as e:
                raise bad_request(f"{at}.arguments is not valid JSON: {e}", f"{at}.arguments") from None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
            if messages and messages[-1]["role"] == "assistant":   # the calls of one assistant turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            items.append({"type": "function_call", "id": item.get("id") or new_id("fc"), "call_id": call_id,
                          "name": name, "arguments": args if isinstance(args, str) else json.dumps(args),
                          "status": "completed"})
        elif kind == "function_call_output":
            call_id = _str(item, "call_id", at)
            output = _text_of(item.get("output"), f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            items.append({"type": "function_call_output", "id": item.get("id") or new_id("fco"), "call_id": call_id,
                          "output": output, "status": "completed"})
        elif kind == "reasoning":
            continue   # earlier thinking is not shown to the model again (as chat templates drop it)
        else:
            raise bad_request(f"{at}.type {kind!r} is not supported (message, function_call, "
                              "function_call_output, reasoning)", f"{at}.type")
    return messages, items


def output_message(blocks: list[Block]) -> dict | None:
    """This turn's output as the assistant chat message a follow-up's prompt holds (reasoning dropped)."""
    text = "".join(b.text for b in blocks if b.kind == "text")
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.arguments()}}
             for b in blocks if b.kind == "tool_call"]
    if not text and not calls:
        return None
    msg: dict = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return msg
