"""Tool calling, the request side: `tools` / `tool_choice` / `parallel_tool_calls` checked, the tools
and the history's calls and results rendered into the prompt, and the grammar that `required` and a
named function put on the output.

The call format is Hermes's (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, results
in `<tool_response>` blocks), the one ChatML-family models (Qwen2.5, Hermes, SmolLM2's tokens) know.
A chat template that renders `tools` itself in that format gets them through its own variables;
any other template (SmolLM2-135M-Instruct's renders only `role` and `content`) gets them written into
its messages here: the tool list at the end of the system message, an assistant's calls in its
content, tool results as a user turn. tool_parser.py reads the same format back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tandem.services.gateway.errors import bad_request
from tandem.services.gateway.structured import Constraint, check_schema
from tandem.v1 import generation_pb2 as pb

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
RESPONSE_BEGIN, RESPONSE_END = "<tool_response>", "</tool_response>"
# What the grammar makes a required/named call look like; the parser accepts any whitespace.
CALL_FORMAT = (CALL_BEGIN + "\n", "\n" + CALL_END, "\n")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (plus dots, as vLLM)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        """The tool as OpenAI's request spells it (what templates and the prompt show the model)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and what it lets the model do with them.
    `choice`: "none" (not offered), "auto" (free text, calls parsed), "required" (at least one call),
    or "function" (calls of `named` only)."""

    tools: tuple[Tool, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def constraint(self) -> Constraint | None:
        """The grammar of `required` / a named function: one schema per callable function."""
        if self.choice not in ("required", "function"):
            return None
        schemas, params = [], []
        for i, t in enumerate(self.tools):
            if self.choice == "function" and t.name != self.named:
                continue
            schemas.append(json.dumps({"type": "object",
                                       "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                                       "required": ["name", "arguments"]}, ensure_ascii=False, separators=(",", ":")))
            params.append(f"tools[{i}].function.parameters")
        begin, end, sep = CALL_FORMAT
        fmt = pb.ToolCallFormat(begin=begin, end=end, separator=sep, schemas=schemas, min_calls=1,
                                max_calls=0 if self.parallel else 1)
        return Constraint(pb.StructuredOutput(tool_calls=fmt), "tool_choice", tuple(params))


def parse_tool_use(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolUse | None:
    """Check `tools`, `tool_choice` and `parallel_tool_calls`; 400s name the field."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if isinstance(tool_choice, dict) or tool_choice == "required":
            raise bad_request("tool_choice requires `tools`", "tool_choice")
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", "tools")
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"tools[{i}].function.name: {name!r} is defined twice", f"tools[{i}].function.name")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return ToolUse(parsed, tool_choice or "auto", None, parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_request("tool_choice.function.name must be a string", "tool_choice.function.name")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not in `tools` ({', '.join(names)})",
                              "tool_choice.function.name")
        return ToolUse(parsed, "function", name, parallel)
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def _tool(t: Any, i: int) -> Tool:
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}].type")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"tools[{i}].function must be an object", f"tools[{i}].function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.'",
                          f"tools[{i}].function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"tools[{i}].function.description must be a string", f"tools[{i}].function.description")
    params = fn.get("parameters")
    if params is None:
        params = _EMPTY_PARAMETERS
    param = f"tools[{i}].function.parameters"
    if not isinstance(params, dict):
        raise bad_request(f"{param} must be a JSON Schema object", param)
    check_schema(params, param)
    return Tool(name, description or "", params)


# ---- the history and the prompt ---------------------------------------------------------------------

def history_calls(m: dict[str, Any], i: int) -> list[dict[str, Any]] | None:
    """An assistant message's `tool_calls`, checked, with `arguments` as an object (as templates want)."""
    calls = m.get("tool_calls")
    if calls is None:
        return None
    at = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{at} must be a list", at)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{at}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}}", f"{at}[{j}].function")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise bad_request(f"{at}[{j}].function.arguments is not valid JSON: {e}",
                                  f"{at}[{j}].function.arguments") from None
        out.append({"id": c.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` itself, in the Hermes format this gateway parses."""
    return bool(template) and re.search(r"\btools\b", template) is not None and CALL_BEGIN in template


def tools_prompt(tools: tuple[Tool, ...]) -> str:
    listing = "\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call the functions below to help with the user's request. Their signatures, "
            f"as JSON, are inside <tools></tools>:\n<tools>\n{listing}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments between "
            f"{CALL_BEGIN}{CALL_END} tags, one call per pair of tags:\n"
            f"{CALL_BEGIN}\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n{CALL_END}")


def render_call(call: dict[str, Any]) -> str:
    fn = call["function"]
    body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"{CALL_BEGIN}\n{body}\n{CALL_END}"


def inline_tools(messages: list[dict[str, Any]], tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    """The messages with tools, calls and results written into plain `role`/`content` turns, for a
    template that knows nothing of them. `tools` empty: only the history is rewritten."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(render_call(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role in ("tool", "function"):
            block = f"{RESPONSE_BEGIN}\n{content}\n{RESPONSE_END}"
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        listing = tools_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{listing}" if first else listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out
