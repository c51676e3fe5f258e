"""Responses items -> chat messages, the request's checks, and the output items and stream events the gateway
builds from the pipeline's choice events."""

from __future__ import annotations

import pytest
from tokenfleet.services.gateway import events as ev
from tokenfleet.services.gateway.responses_api import ResponseBuilder

from tokenfleet.api.openai_schema import APIError, ChatCompletionRequest
from tokenfleet.api.tools import ToolCall
from tokenfleet.responses import schema as rs


def body(**fields) -> rs.ResponsesRequest:
    return rs.ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_text_input_is_one_user_message_after_the_instructions():
    items = rs.input_items(body(input="What is 2+2?"))
    assert [(i["type"], i["role"]) for i in items] == [("message", "user")] and items[0]["id"].startswith("msg_")
    assert rs.chat_messages(items, "Be brief.") == [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "What is 2+2?"}]


def test_a_tool_loop_becomes_assistant_tool_calls_and_tool_messages():
    transcript = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
    ]
    messages = rs.chat_messages(transcript, None)
    assert messages[1] == {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "{\"x\": 1}"}}]}
    assert messages[2:] == [{"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                            {"role": "tool", "tool_call_id": "c2", "content": "rain"}]


def test_an_output_for_no_call_is_a_400():
    with pytest.raises(APIError) as caught:
        rs.chat_messages([{"type": "function_call_output", "call_id": "nope", "output": "x"}], None)
    assert caught.value.status == 400 and "nope" in caught.value.message


@pytest.mark.parametrize("fields,param", [
    ({"temperature": 0, "frobnicate": 1}, "frobnicate"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"background": True, "stream": True}, "stream"),
    ({"tools": [{"type": "file_search"}]}, "tools.0.type"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
])
def test_checks_name_the_field(fields, param):
    with pytest.raises(APIError) as caught:
        body(**fields).check()
    assert caught.value.param == param


def test_the_chat_request_carries_generation_fields():
    b = body(tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
             tool_choice={"type": "function", "name": "f"}, max_output_tokens=7, temperature=0.5,
             text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}})
    chat = ChatCompletionRequest.model_validate(rs.chat_request(b, [{"role": "user", "content": "hi"}]))
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5 and chat.tool_choice_name == "f"
    assert chat.tools[0].function.name == "f" and chat.response_format.type == "json_schema"


def test_the_builder_announces_each_item_before_its_deltas_and_closes_it():
    builder = ResponseBuilder()
    stream = []
    for event in (ev.Opened(0), ev.Text(0, "Let me "), ev.Text(0, "check."),
                  ev.ToolCallStarted(0, 0, ToolCall("call_1", "w")), ev.ToolArguments(0, 0, "{\"a\""),
                  ev.ToolArguments(0, 0, ": 1}"), ev.Finished(0, "tool_calls", "", None), ev.Ended(ev.Usage(10, 5, 4))):
        stream += builder.feed(event)
    assert [e["type"] for e in stream] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    assert stream[0]["item"]["content"] == []  # announced empty, as OpenAI's; the part follows
    assert stream[1]["part"]["text"] == "" and stream[6]["item"]["content"][0]["text"] == "Let me check."
    message, call = builder.output
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "w", "{\"a\": 1}")
    assert [e["output_index"] for e in stream] == [0] * 7 + [1] * 5
    assert builder.usage == ev.Usage(10, 5, 4) and builder.status == "completed"


def test_a_length_stop_is_an_incomplete_response():
    builder = ResponseBuilder()
    for event in (ev.Text(0, "abc"), ev.Finished(0, "length", "abc", "abc")):
        builder.feed(event)
    assert builder.status == "incomplete" and builder.output[0]["status"] == "incomplete"


def test_an_aborted_generation_is_a_failed_response():
    builder = ResponseBuilder()
    for event in (ev.Text(0, "ab"), ev.Finished(0, "abort", "ab", "ab")):
        builder.feed(event)
    assert builder.status == "failed"
