"""What one request may cost the engine's shared loop (`engine.request_cost`): shapes whose
sampling cost grows with every token are refused at the door, named, before llama-server sees
them. Found by an attacker: a grammar of 50 identical alternatives took another mind's 64
tokens from 0.01 s to 1.5 s (400: no answer in 60 s)."""

from __future__ import annotations

import pytest

from continuum_operator.engine.request_cost import (
    DEFAULT_BOUNDS,
    grammar_fanout,
    request_cost_error,
    schema_shape,
)

JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
# optional space
ws ::= | " " | "\n" [ \t]{0,20}
"""


def alternatives(k: int) -> str:
    return "root ::= (" + "|".join(['"a"'] * k) + ")*"


@pytest.mark.parametrize("k", [50, 400])
def test_a_grammar_of_many_identical_alternatives_is_refused_with_the_field_named(k: int) -> None:
    bad = request_cost_error({"grammar": alternatives(k), "ignore_eos": True})
    assert bad is not None and bad.param == "grammar"
    assert f"opens {k + 2} alternatives" in bad.message
    assert "character class" in bad.message


def test_pairs_of_alternatives_nested_through_rules_are_counted_multiplied() -> None:
    rules = [f"x{i} ::= (x{i + 1} | x{i + 1})" for i in range(9)] + ['x9 ::= "a"']
    grammar = "root ::= x0*\n" + "\n".join(rules)
    assert grammar_fanout(grammar)[0] == 2**9 + 2
    bad = request_cost_error({"grammar": grammar})
    assert bad is not None and bad.param == "grammar"


def test_ordinary_grammars_and_schemas_pass() -> None:
    assert grammar_fanout(JSON_GBNF)[0] <= DEFAULT_BOUNDS.fanout
    assert request_cost_error({"grammar": JSON_GBNF}) is None
    assert request_cost_error({"grammar": alternatives(8)}) is None
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 64},
            "kind": {"enum": ["a", "b", "c"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
        },
        "required": ["name"],
    }
    assert request_cost_error({"json_schema": schema}) is None
    assert (
        request_cost_error(
            {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
        )
        is None
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert (
        request_cost_error({"tools": tools, "stop": ["\n", "END"], "logit_bias": {"15": -100}})
        is None
    )


def test_a_grammar_that_cannot_be_read_or_left_recursive_is_refused() -> None:
    assert request_cost_error({"grammar": 'root ::= "a'}) is not None
    assert request_cost_error({"grammar": 'root ::= root "a" | "b"'}) is not None
    assert request_cost_error({"grammar": "root ::= x"}) is not None  # undefined rule


def test_repetitions_that_copy_elements_too_often_are_refused() -> None:
    bad = request_cost_error({"grammar": 'root ::= "a"{0,100000}'})
    assert bad is not None and "repetitions" in bad.message


def test_a_big_grammar_is_refused_by_its_bytes() -> None:
    grammar = "root ::= " + " ".join(['"ab"'] * 5000)
    bad = request_cost_error({"grammar": grammar})
    assert bad is not None and "bytes" in bad.message


def test_schemas_of_many_alternatives_anywhere_are_refused_under_their_own_name() -> None:
    wide = {"type": "object", "properties": {"x": {"enum": [str(i) for i in range(40)]}}}
    bad = request_cost_error({"json_schema": wide})
    assert bad is not None and bad.param == "json_schema" and "opens 40" in bad.message
    nested = {"anyOf": [{"anyOf": [{"type": "string"}] * 20}, {"enum": list(range(20))}]}
    assert schema_shape(nested).fanout == 40
    bad = request_cost_error({"response_format": {"type": "json_object", "schema": nested}})
    assert bad is not None and bad.param == "response_format"
    optional = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)}}
    assert request_cost_error({"json_schema": optional}) is not None
    tools = [{"type": "function", "function": {"name": "f", "parameters": wide}}]
    bad = request_cost_error({"tools": tools})
    assert bad is not None and bad.param == "tools[0].function.parameters"


def test_deep_schemas_and_huge_size_keywords_are_refused() -> None:
    deep: dict[str, object] = {"type": "string"}
    for _ in range(20):
        deep = {"type": "array", "items": deep}
    assert request_cost_error({"json_schema": deep}) is not None
    bad = request_cost_error({"json_schema": {"type": "string", "maxLength": 10**6}})
    assert bad is not None and "maxLength 1000000" in bad.message


def test_lists_read_at_every_step_are_bounded() -> None:
    assert request_cost_error({"stop": ["x"] * 17}) is not None
    assert request_cost_error({"stop": "x" * 300}) is not None
    assert request_cost_error({"logit_bias": {str(i): 1 for i in range(2000)}}) is not None
    assert request_cost_error({"logit_bias": [["x" * 300, 1.0]]}) is not None
    assert request_cost_error({"dry_sequence_breakers": ["\n"] * 17}) is not None
    assert request_cost_error({"dry_sequence_breakers": ["x" * 41]}) is not None
    assert request_cost_error({"samplers": ["top_k"] * 17}) is not None
    assert request_cost_error({"tools": [{}] * 33}) is not None
