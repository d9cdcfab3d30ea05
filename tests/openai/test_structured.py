"""A request's structured output in each of its forms (hcache/openai/structured.py): the one grammar the
model server gets, and a bad or doubled one refused with a 400 naming its field."""

from __future__ import annotations

import json

import pytest

from hcache.openai.api_error import APIError
from hcache.openai.protocol import ChatCompletionRequest, CompletionRequest
from hcache.openai.structured import structured_output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _grammar(**fields) -> dict | None:
    option = structured_output(ChatCompletionRequest(**CHAT, **fields))
    return None if option is None else json.loads(option)


@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        ({"structured_outputs": {"json": SCHEMA}}, "json", json.dumps(SCHEMA)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", json.dumps(SCHEMA)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"choice": ["yes", 'a "b"']}}, "grammar", 'root ::= "yes" | "a \\"b\\""'),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar", 'root ::= "x"'),
        ({"structured_outputs": {"json_object": True}}, "json", '{"type": "object"}'),
        ({"guided_json": SCHEMA}, "json", json.dumps(SCHEMA)),
        ({"guided_regex": "[a-z]"}, "regex", "[a-z]"),
        ({"guided_choice": ["Paris", "Berlin"]}, "grammar", 'root ::= "Paris" | "Berlin"'),
        ({"guided_grammar": 'root ::= "y"'}, "grammar", 'root ::= "y"'),
        ({"response_format": {"type": "json_object"}}, "json", '{"type": "object"}'),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}, "json", None),
    ],
)
def test_each_form_becomes_one_grammar(fields, kind, value):
    grammar = _grammar(**fields)
    assert grammar["kind"] == kind
    if value is not None:
        assert grammar["value"] == value
    elif "json_schema" in json.dumps(fields):
        assert json.loads(grammar["value"]) == SCHEMA


def test_none_asked_is_none_and_completions_take_it_too():
    assert _grammar() is None and _grammar(response_format={"type": "text"}, structured_outputs={}) is None
    assert _grammar(guided_choice=[], structured_outputs={"disable_fallback": False}) is None
    completion = CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "a+"})
    assert json.loads(structured_output(completion))["kind"] == "regex"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs", "parenthesis"),
        ({"guided_json": "{bad"}, "guided_json", "JSON"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF"),
        ({"structured_outputs": {"choice": ["", "x"]}}, "structured_outputs", "non-empty strings"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured output"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
    ],
)
def test_a_bad_or_second_structured_output_is_refused_naming_its_field(fields, param, words):
    with pytest.raises(APIError) as refused:
        _grammar(**fields)
    body = json.loads(refused.value.response().body)["error"]
    assert refused.value.response().status_code == 400 and body["param"] == param and words in body["message"]
