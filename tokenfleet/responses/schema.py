"""The Responses API's request, its input and output items, and the response object, as OpenAI's API defines them.

A request is served as a chat completion: its transcript (the previous responses' input and output items, then
``instructions`` as the system message and this request's input) becomes chat messages (``chat_messages``), and
the body's generation fields become a ``ChatCompletionRequest`` (``chat_request``), so templates, tool calling and
structured output are the chat path's own. Items are plain JSON dicts, kept as the client sent them (each given
an id) and returned as stored.

Served: ``input`` as text or message / ``function_call`` / ``function_call_output`` items (text parts only),
``instructions``, ``previous_response_id``, ``store``, ``background``, ``stream``, function ``tools`` and
``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text, json_object, json_schema), ``max_output_tokens``,
``temperature``, ``top_p``, ``metadata``, ``prompt_cache_key``, ``prompt_cache_retention``. Anything else that
changes generation is a 400 naming it; bookkeeping fields (``user``, ``safety_identifier``, ``service_tier``) are
accepted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenfleet.api.openai_schema import APIError

MAX_INPUT_ITEMS = 2048
MAX_METADATA_KEYS = 16  # as OpenAI: 16 pairs, keys up to 64 characters, values up to 512
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_CACHE_KEY = 256
INFORMATIONAL = {"user", "safety_identifier", "service_tier", "stream_options"}
RETENTION_SECONDS = {"in_memory": None, "24h": 24 * 3600.0}  # None: the gateway's window


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity: accepted, no effect
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # collected and rejected by name in ``check``

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_CACHE_KEY)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping earlier items to fit) is not served
    include: list[str] | None = None
    reasoning: None = None

    def check(self) -> None:
        """The 400s a body's types alone do not catch."""
        extra = sorted(set(self.model_extra or {}) - INFORMATIONAL)
        if extra:
            raise APIError(400, f"Unsupported parameter(s): {', '.join(extra)}. This server does not implement "
                           "them, and does not ignore them silently.", param=extra[0], code="unsupported_parameter")
        if self.include:
            raise APIError(400, f"include: {self.include[0]!r} is not served", param="include",
                           code="unsupported_parameter")
        if self.background and not self.store:
            raise APIError(400, "background responses must be stored (store=true)", param="background")
        if self.background and self.stream:
            raise APIError(400, "background responses are not streamed here: create it, then retrieve it",
                           param="stream", code="unsupported_parameter")
        if isinstance(self.input, list) and len(self.input) > MAX_INPUT_ITEMS:
            raise APIError(400, f"at most {MAX_INPUT_ITEMS} input items, got {len(self.input)}", param="input")
        if isinstance(self.input, str) and not self.input.strip():
            raise APIError(400, "input must not be empty", param="input")
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_KEYS or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                                                for k, v in meta.items()):
            raise APIError(400, f"metadata: at most {MAX_METADATA_KEYS} pairs, keys up to {MAX_METADATA_KEY} "
                           f"characters, values up to {MAX_METADATA_VALUE}", param="metadata")
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise APIError(400, f"tools[{i}]: only function tools are served, got {tool.get('type')!r}",
                               param=f"tools.{i}.type", code="unsupported_parameter")
            if not isinstance(tool.get("name"), str):
                raise APIError(400, f"tools[{i}]: a function tool needs a name", param=f"tools.{i}.name")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input as items, each with an id (text input is one user message)."""
    raw: list[Any] = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else list(body.input)
    items = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}] must be an object", param=f"input.{i}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input[{i}].role must be user, system, developer or assistant, got {role!r}",
                               param=f"input.{i}.role")
            text = _text(item.get("content"), f"input.{i}.content")
            if role != "assistant" and not text.strip():
                raise APIError(400, f"input[{i}].content must not be empty", param=f"input.{i}.content")
            items.append({"id": item.get("id") or new_id("msg"), "type": "message", "role": role,
                          "content": _parts(item.get("content"), role), "status": "completed"})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError(400, f"input[{i}].{key} must be a string", param=f"input.{i}.{key}")
            items.append({"id": item.get("id") or new_id("fc"), "type": "function_call", "call_id": item["call_id"],
                          "name": item["name"], "arguments": item["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"input[{i}].call_id must be a string", param=f"input.{i}.call_id")
            output = _text(item.get("output"), f"input.{i}.output")
            items.append({"id": item.get("id") or new_id("fco"), "type": "function_call_output",
                          "call_id": item["call_id"], "output": output, "status": "completed"})
        else:
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not served (message, function_call and "
                           "function_call_output are)", param=f"input.{i}.type", code="unsupported_parameter")
    if not items:
        raise APIError(400, "input must hold at least one item", param="input")
    return items


def _text(content: Any, param: str) -> str:
    """The text of a message's content or a call's output: a string, or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise APIError(400, f"{param}[{j}]: only text parts are served, got {kind!r}", param=f"{param}.{j}",
                               code="unsupported_parameter")
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"{param} must be a string or a list of text parts", param=param)


def _parts(content: Any, role: str) -> list[dict[str, Any]]:
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    return [{"type": part["type"] if part["type"] != "text" else kind, "text": part["text"]} for part in content or []]


def chat_messages(transcript: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages for a transcript of items (earlier turns' inputs and outputs, then this request's input):
    ``instructions`` first as the system message; consecutive function calls (after any assistant text) become one
    assistant message's tool calls; each call's output a tool message. A call output whose ``call_id`` names no
    earlier call is a 400."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    calls: set[str] = set()
    for item in transcript:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item["content"], "input")})
        elif kind == "function_call":
            calls.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                raise APIError(400, f"No tool call found for function call output with call_id {item['call_id']}.",
                               param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion body that generates this response (the gateway validates it as a
    ``ChatCompletionRequest``, as it does a chat body)."""
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "parallel_tool_calls": body.parallel_tool_calls}
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    for key in ("temperature", "top_p", "prompt_cache_key", "prompt_cache_retention"):
        if getattr(body, key) is not None:
            chat[key] = getattr(body, key)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                         for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice: a function choice is {\"type\": \"function\", \"name\": ...}",
                           param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if not fmt.name or fmt.schema_ is None:
            raise APIError(400, "text.format json_schema needs a name and a schema", param="text.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    return chat


def output_items(content: str | None, calls: list[tuple[str, str, str]], status: str = "completed",
                 message_id: str | None = None, call_ids: list[str] | None = None) -> list[dict[str, Any]]:
    """A response's output: the assistant's text as one message item (when there is text), then one
    ``function_call`` item per call (call_id, name, arguments)."""
    items: list[dict[str, Any]] = []
    if content:
        items.append(message_item(message_id or new_id("msg"), content, status))
    for k, (call_id, name, arguments) in enumerate(calls):
        items.append(call_item((call_ids or [])[k] if call_ids and k < len(call_ids) else new_id("fc"), call_id,
                               name, arguments, status))
    return items


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(response_id: str, body: ResponsesRequest, status: str, output: list[dict[str, Any]] | None = None,
                    usage_: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
                    incomplete: str | None = None, created_at: float | None = None, model: str | None = None,
                    stored: bool | None = None) -> dict[str, Any]:
    """OpenAI's ``response`` object. ``stored``: whether it was kept (``store`` unless the tenant's quota was
    used up)."""
    return {
        "id": response_id, "object": "response", "created_at": int(created_at if created_at is not None else time.time()),
        "status": status, "background": body.background, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": model or body.model, "output": output or [], "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id, "metadata": body.metadata or {},
        "store": body.store if stored is None else stored, "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                            if body.text is not None and body.text.format is not None else {"type": "text"})},
        "tool_choice": body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
        "tools": body.tools or [], "truncation": body.truncation or "disabled",
        "prompt_cache_key": body.prompt_cache_key, "prompt_cache_retention": body.prompt_cache_retention,
        "usage": usage_, "user": (body.model_extra or {}).get("user"),
    }
