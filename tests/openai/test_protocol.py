"""Every request field OpenAI or vLLM documents is honoured or refused naming it (hcache/openai/protocol.py),
checked without a server: the request models and :func:`unsupported`."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hcache.openai.protocol import ChatCompletionRequest, CompletionRequest, unsupported

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"truncation_side": "right"}, "truncation_side"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"echo": True}, "echo"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"return_token_ids": True}, "return_token_ids"),
    ],
)
def test_a_field_this_server_cannot_honour_is_refused_naming_it(fields, param):
    problem = unsupported(ChatCompletionRequest(**CHAT, **fields))
    assert problem is not None and problem[0] == param and param in problem[1]


@pytest.mark.parametrize(
    "fields",
    [
        {"use_beam_search": False, "length_penalty": 1, "prompt_logprobs": None, "truncation_side": "left"},
        {"functions": [], "tool_choice": "none", "chat_template_kwargs": {}},
        {"tool_choice": "auto", "echo": False, "add_generation_prompt": True},
        {"some_future_field": 3},  # neither OpenAI nor vLLM documents it: ignored
    ],
)
def test_defaults_and_unknown_fields_ask_for_nothing_and_pass(fields):
    assert unsupported(ChatCompletionRequest(**CHAT, **fields)) is None


def test_chat_only_fields_are_the_completions_own_or_unknown_there():
    assert unsupported(CompletionRequest(**COMPLETION, echo=True, chat_template="x")) is None
    assert unsupported(CompletionRequest(**COMPLETION, use_beam_search=True))[0] == "use_beam_search"


def test_a_boolean_is_no_number():
    assert unsupported(ChatCompletionRequest(**CHAT, use_beam_search=0))[0] == "use_beam_search"


@pytest.mark.parametrize("temperature", [0, 0.7])
def test_top_k_below_minus_one_is_refused_whatever_the_temperature(temperature):
    with pytest.raises(ValidationError, match="top_k"):
        ChatCompletionRequest(**CHAT, temperature=temperature, top_k=-5)
    assert ChatCompletionRequest(**CHAT, temperature=temperature, top_k=-1).top_k == -1


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"bad_words": "word"}, "bad_words"),
    ],
)
def test_vllms_fields_are_typed(fields, where):
    with pytest.raises(ValidationError, match=where):
        CompletionRequest(**COMPLETION, **fields)
