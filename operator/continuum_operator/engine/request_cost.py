"""What one request may cost the engine's shared loop, decided before llama-server sees it.

llama-server samples every slot in one loop, one token of each slot per step: a field whose
cost grows with every token (a grammar, a JSON schema, which llama-server turns into a
grammar) is paid by every other mind's decode, not hers alone. A grammar of 50 identical
alternatives under a repetition (`root ::= ("a"|"a"|...)*`, 477 bytes) took another mind's
64 tokens from 0.01 s to 1.5 s on a model of 512 tokens; a real vocabulary is a hundred times
larger. What drives it (llama.cpp's `llama_grammar_apply`/`llama_grammar_accept`): each
sampling step matches every candidate token against every parse stack the grammar holds at
that position, and accepting a character advances every stack, each advance expanding the
next element into all its alternatives. So the bound here is on **the stacks a grammar can
open at one position** (`fanout`: the alternatives reached from one element, through rule
references, groups and optional elements), not only on its bytes; nested pairs of
alternatives (`x ::= (y|y)`, `y ::= (z|z)`, ...) multiply and are counted so.

`request_cost_error(body)` is pure: None, or the first field over its bound as a
`FieldError` (param named, what to do). Bounds (`CostBounds`) are per field:

- `grammar`: at most 16 KiB, `fanout` at most 32, repetition counts (`{m,n}`, which
  llama.cpp expands into copies of the element) summing to at most 4,096;
- `json_schema`, `response_format`'s schema, each tool's `parameters`: at most 16 KiB, 16
  levels deep, `fanout` (the alternatives of `anyOf`/`oneOf`/`enum`/type lists met at one
  position, optional properties of one object, a `pattern`'s `|`) at most 32, each size
  keyword (`maxLength`, `maxItems`, ...) at most 4,096;
- `tools`: at most 32, all of them 64 KiB;
- `logit_bias`: at most 1,024 entries (each applied at every step), a string key at most
  256 bytes (llama-server tokenizes it);
- `stop`: at most 16 strings of 256 bytes (each searched for at every step);
- `dry_sequence_breakers`: at most 16 of 40 characters (llama.cpp's DRY sampler matches each
  against the whole vocabulary when the slot starts, in the loop);
- `samplers`: at most 16 names.

These bounds are shapes, not times: what a shape costs depends on the model's vocabulary and
the machine. `engine.watchdog` measures what a request costs the other slots while it runs and
cuts it past what sharing the engine costs anyway. Neighbours: `engine.openai_api` (the
allow-list, which runs first), `engine.gateway` (calls this after it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from continuum_operator.engine.openai_api import FieldError

__all__ = [
    "DEFAULT_BOUNDS",
    "CostBounds",
    "SchemaShape",
    "costly_fields",
    "grammar_fanout",
    "request_cost_error",
    "schema_shape",
]


@dataclass(frozen=True, slots=True)
class CostBounds:
    """The most a request's fields may ask of the shared loop (see the module's docstring)."""

    grammar_bytes: int = 16 * 1024
    #: Parse stacks one position of a grammar (or a schema's grammar) may open.
    fanout: int = 32
    #: Copies llama.cpp makes for `{m,n}` repetitions in one grammar, all together.
    grammar_repeats: int = 4096
    schema_bytes: int = 16 * 1024
    schema_depth: int = 16
    #: Each of maxLength, minLength, maxItems, minItems, maxProperties, minProperties.
    schema_size_keyword: int = 4096
    tools: int = 32
    tools_bytes: int = 64 * 1024
    logit_bias: int = 1024
    logit_bias_key_bytes: int = 256
    stops: int = 16
    stop_bytes: int = 256
    dry_breakers: int = 16
    dry_breaker_chars: int = 40
    samplers: int = 16


DEFAULT_BOUNDS = CostBounds()

#: Past this a fanout is only "too many" (keeps the arithmetic of hostile grammars small).
_MANY = 1 << 20


class _Costly(Exception):
    def __init__(self, param: str, message: str) -> None:
        self.error = FieldError(param, message)


# --- grammars (GBNF) ---------------------------------------------------------------------------

_GBNF_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
    |(?P<define>::=)
    |(?P<literal>"(?:\\.|[^"\\])*")
    |(?P<klass>\[(?:\\.|[^\]\\])*\])
    |(?P<token><\[[^\]]*\]>|!<\[[^\]]*\]>|<[^<>\s]*>|!<[^<>\s]*>)
    |(?P<name>[A-Za-z0-9_-]+)
    |(?P<open>\()|(?P<close>\))|(?P<bar>\|)|(?P<dot>\.)
    |(?P<repeat>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
    |(?P<op>[*+?])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str
    text: str


def _gbnf_tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    while pos < len(text):
        m = _GBNF_TOKEN.match(text, pos)
        if m is None:
            raise _Costly(
                "grammar", f"grammar: cannot read it at byte {pos} ({text[pos : pos + 20]!r})"
            )
        kind = m.lastgroup or ""
        if kind != "space":
            out.append(_Tok(kind, m.group()))
        pos = m.end()
    return out


# An element: ("ref", name) | ("term", None) | ("group", [alternatives]); with its repetition
# as (least, most or None).
_Seq = list[tuple[Any, tuple[int, int | None]]]


def _repeat_bounds(tok: _Tok) -> tuple[int, int | None]:
    if tok.text == "*":
        return 0, None
    if tok.text == "+":
        return 1, None
    if tok.text == "?":
        return 0, 1
    inner = tok.text[1:-1].replace(" ", "")
    low, comma, high = inner.partition(",")
    least = int(low) if low else 0
    if not comma:
        return least, least
    return least, int(high) if high else None


class _GrammarReader:
    """The rules of a GBNF text, as far as their shape goes (what each element may expand to)."""

    def __init__(self, tokens: list[_Tok]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.repeats = 0
        self.rules: dict[str, list[_Seq]] = {}

    def read(self) -> dict[str, list[_Seq]]:
        while self.pos < len(self.tokens):
            name = self.tokens[self.pos]
            if name.kind != "name" or self._at(self.pos + 1) != "define":
                raise _Costly(
                    "grammar", f"grammar: expected a rule `name ::= ...` at {name.text!r}"
                )
            self.pos += 2
            self.rules.setdefault(name.text, []).extend(self._alternatives(top=True))
        return self.rules

    def _at(self, i: int) -> str:
        return self.tokens[i].kind if i < len(self.tokens) else ""

    def _rule_starts(self) -> bool:
        return self._at(self.pos) == "name" and self._at(self.pos + 1) == "define"

    def _alternatives(self, *, top: bool) -> list[_Seq]:
        alts = [self._sequence(top=top)]
        while self._at(self.pos) == "bar":
            self.pos += 1
            alts.append(self._sequence(top=top))
        return alts

    def _sequence(self, *, top: bool) -> _Seq:
        seq: _Seq = []
        while self.pos < len(self.tokens):
            kind = self._at(self.pos)
            if kind in ("bar", "close") or (top and self._rule_starts()):
                break
            if kind in ("op", "repeat"):
                if not seq:
                    raise _Costly("grammar", "grammar: a repetition with nothing before it")
                least, most = _repeat_bounds(self.tokens[self.pos])
                self.repeats += max(least, most or 1)
                seq[-1] = (seq[-1][0], (least, most))
                self.pos += 1
                continue
            seq.append((self._element(kind), (1, 1)))
        return seq

    def _element(self, kind: str) -> Any:
        tok = self.tokens[self.pos]
        self.pos += 1
        if kind == "name":
            return ("ref", tok.text)
        if kind == "open":
            alts = self._alternatives(top=False)
            if self._at(self.pos) != "close":
                raise _Costly("grammar", "grammar: a group `(` without its `)`")
            self.pos += 1
            return ("group", alts)
        if kind in ("literal", "klass", "token", "dot"):
            return ("term", None)
        raise _Costly("grammar", f"grammar: unexpected {tok.text!r}")


class _Fanout:
    """The parse stacks each element opens at one position (capped at `_MANY`)."""

    def __init__(self, rules: Mapping[str, list[_Seq]]) -> None:
        self.rules = rules
        self.memo: dict[str, tuple[int, bool]] = {}
        self.open: set[str] = set()

    def rule(self, name: str) -> tuple[int, bool]:
        if name in self.memo:
            return self.memo[name]
        if name in self.open or name not in self.rules:
            # Left recursion (llama.cpp refuses it) or an undefined rule: counted as too many.
            return _MANY, False
        self.open.add(name)
        found = self.alternatives(self.rules[name])
        self.open.discard(name)
        self.memo[name] = found
        return found

    def alternatives(self, alts: list[_Seq]) -> tuple[int, bool]:
        total, nullable = 0, False
        for seq in alts:
            n, null = self.sequence(seq)
            total, nullable = min(_MANY, total + n), nullable or null
        return total, nullable

    def sequence(self, seq: _Seq) -> tuple[int, bool]:
        """Stacks opened at the sequence's start: its first element's, and the next one's
        while those before may be empty."""
        total = 0
        for element, (least, _) in seq:
            n, null = self.element(element)
            if least == 0:
                n, null = n + 1, True  # the empty branch is a stack of its own
            total = min(_MANY, total + n)
            if not null:
                return total, False
        return max(total, 1), True

    def element(self, element: Any) -> tuple[int, bool]:
        kind, value = element
        if kind == "ref":
            return self.rule(value)
        if kind == "group":
            return self.alternatives(value)
        return 1, False

    def widest(self) -> int:
        """The most stacks any position of the grammar opens: every suffix of every sequence,
        each counted from the right (the next element's, and past it while it may be empty)."""
        widest = 0
        for alts in self.rules.values():
            for seq in _all_sequences(alts):
                after = 1  # the end of the sequence: one stack, popped to what follows it
                for element, (least, _) in reversed(seq):
                    n, null = self.element(element)
                    if least == 0:
                        n, null = n + 1, True
                    after = min(_MANY, n + after) if null else n
                    widest = max(widest, after)
        return widest


def _all_sequences(alts: list[_Seq]) -> Iterator[_Seq]:
    for seq in alts:
        yield seq
        for element, _ in seq:
            if element[0] == "group":
                yield from _all_sequences(element[1])


def grammar_fanout(text: str) -> tuple[int, int]:
    """(the most parse stacks a position of the GBNF `text` opens, its repetition copies).
    Raises `FieldError`-carrying `_Costly` where the text cannot be read."""
    reader = _GrammarReader(_gbnf_tokens(text))
    rules = reader.read()
    return _Fanout(rules).widest(), reader.repeats


def _check_grammar(grammar: Any, bounds: CostBounds) -> None:
    if grammar is None:
        return
    if not isinstance(grammar, str):
        raise _Costly("grammar", "grammar: a GBNF text")
    size = len(grammar.encode())
    if size > bounds.grammar_bytes:
        raise _Costly(
            "grammar", f"grammar: {size} bytes, more than the {bounds.grammar_bytes} served"
        )
    fanout, repeats = grammar_fanout(grammar)
    if fanout > bounds.fanout:
        raise _Costly(
            "grammar",
            f"grammar: one position opens {_many(fanout)} alternatives (through rules, groups "
            f"and optional elements), more than the {bounds.fanout} served: llama-server "
            "matches every token of the vocabulary against each at every step, for every "
            "mind on the engine; merge identical alternatives, or use a character class",
        )
    if repeats > bounds.grammar_repeats:
        raise _Costly(
            "grammar",
            f"grammar: repetitions ({{m,n}}) copy elements {repeats} times, more than the "
            f"{bounds.grammar_repeats} served",
        )


def _many(n: int) -> str:
    return f"over {_MANY}" if n >= _MANY else str(n)


# --- JSON schemas ------------------------------------------------------------------------------

_SIZE_KEYWORDS = (
    "maxLength",
    "minLength",
    "maxItems",
    "minItems",
    "maxProperties",
    "minProperties",
)


@dataclass(frozen=True, slots=True)
class SchemaShape:
    depth: int
    fanout: int
    size_keyword: tuple[str, int] | None  # the largest size keyword, if any


def _first(schema: Any) -> int:
    """The alternatives a schema opens at its first position."""
    if not isinstance(schema, dict):
        return 1
    total = 0
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            total += sum(_first(b) for b in branches)
    enum = schema.get("enum")
    if isinstance(enum, list):
        total += len(enum)
    types = schema.get("type")
    if isinstance(types, list):
        total += len(types)
    return min(_MANY, max(total, 1))


def _local(schema: dict[str, Any]) -> int:
    """The widest position inside the schema's own grammar (not its children's)."""
    widest = _first(schema)
    props = schema.get("properties")
    if isinstance(props, dict):
        required = schema.get("required")
        needed = set(required) if isinstance(required, list) else set()
        widest = max(widest, sum(1 for p in props if p not in needed) + 1)
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        widest = max(widest, pattern.count("|") + 1)
    return widest


def schema_shape(schema: Any) -> SchemaShape:
    """Depth, widest position and largest size keyword of a JSON schema (every subschema)."""
    depth = fanout = 0
    size: tuple[str, int] | None = None
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, list):
            stack.extend((x, level) for x in node)
            continue
        if not isinstance(node, dict):
            continue
        depth = max(depth, level)
        fanout = max(fanout, _local(node))
        for key in _SIZE_KEYWORDS:
            value = node.get(key)
            if isinstance(value, int) and (size is None or value > size[1]):
                size = (key, value)
        stack.extend((v, level + 1) for v in node.values() if isinstance(v, dict | list))
    return SchemaShape(depth, fanout, size)


def _check_schema(param: str, schema: Any, bounds: CostBounds) -> None:
    if schema is None:
        return
    size = len(json.dumps(schema).encode())
    if size > bounds.schema_bytes:
        raise _Costly(param, f"{param}: {size} bytes, more than the {bounds.schema_bytes} served")
    shape = schema_shape(schema)
    if shape.depth > bounds.schema_depth:
        raise _Costly(
            param,
            f"{param}: nested {shape.depth} levels deep, more than the {bounds.schema_depth} "
            "served",
        )
    if shape.fanout > bounds.fanout:
        raise _Costly(
            param,
            f"{param}: one position opens {_many(shape.fanout)} alternatives (anyOf, oneOf, "
            f"enum, type lists, optional properties, a pattern's |), more than the "
            f"{bounds.fanout} served: llama-server matches every token of the vocabulary "
            "against each at every step, for every mind on the engine",
        )
    if shape.size_keyword is not None and shape.size_keyword[1] > bounds.schema_size_keyword:
        key, value = shape.size_keyword
        raise _Costly(
            param,
            f"{param}: {key} {value}, more than the {bounds.schema_size_keyword} served "
            "(llama-server writes one grammar element per unit of it)",
        )


def _response_schema(response_format: Any) -> Any:
    if not isinstance(response_format, dict):
        return None
    nested = response_format.get("json_schema")
    if isinstance(nested, dict) and "schema" in nested:
        return nested["schema"]
    return response_format.get("schema")


def _check_tools(tools: Any, bounds: CostBounds) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _Costly("tools", "tools: a list of tools")
    if len(tools) > bounds.tools:
        raise _Costly("tools", f"tools: {len(tools)}, more than the {bounds.tools} served")
    size = len(json.dumps(tools).encode())
    if size > bounds.tools_bytes:
        raise _Costly("tools", f"tools: {size} bytes, more than the {bounds.tools_bytes} served")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict):
            _check_schema(f"tools[{i}].function.parameters", function.get("parameters"), bounds)


# --- lists read at every step ------------------------------------------------------------------


def _check_logit_bias(bias: Any, bounds: CostBounds) -> None:
    if bias is None or isinstance(bias, bool):
        return
    entries = list(bias.items()) if isinstance(bias, dict) else bias
    if not isinstance(entries, list):
        return  # llama-server's own error says what it takes
    if len(entries) > bounds.logit_bias:
        raise _Costly(
            "logit_bias",
            f"logit_bias: {len(entries)} entries, more than the {bounds.logit_bias} served",
        )
    for entry in entries:
        key = entry[0] if isinstance(entry, list | tuple) and entry else None
        if isinstance(key, str) and len(key.encode()) > bounds.logit_bias_key_bytes:
            raise _Costly(
                "logit_bias",
                f"logit_bias: a string of {len(key.encode())} bytes, more than the "
                f"{bounds.logit_bias_key_bytes} served",
            )


def _check_strings(
    param: str, value: Any, most: int, longest: int, unit: str, *, as_bytes: bool
) -> None:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        return
    if len(items) > most:
        raise _Costly(param, f"{param}: {len(items)} entries, more than the {most} served")
    for item in items:
        if isinstance(item, str):
            size = len(item.encode()) if as_bytes else len(item)
            if size > longest:
                raise _Costly(
                    param, f"{param}: an entry of {size} {unit}, more than the {longest} served"
                )


def request_cost_error(
    body: Mapping[str, Any], bounds: CostBounds = DEFAULT_BOUNDS
) -> FieldError | None:
    """None if `body`'s fields stay within what one request may cost the shared loop; else
    the first one over its bound, named, with what to do."""
    try:
        _check_grammar(body.get("grammar"), bounds)
        _check_schema("json_schema", body.get("json_schema"), bounds)
        _check_schema("response_format", _response_schema(body.get("response_format")), bounds)
        _check_tools(body.get("tools"), bounds)
        _check_logit_bias(body.get("logit_bias"), bounds)
        _check_strings("stop", body.get("stop"), bounds.stops, bounds.stop_bytes, "bytes",
                       as_bytes=True)  # fmt: skip
        _check_strings(
            "dry_sequence_breakers",
            body.get("dry_sequence_breakers"),
            bounds.dry_breakers,
            bounds.dry_breaker_chars,
            "characters",
            as_bytes=False,
        )
        samplers = body.get("samplers")
        if isinstance(samplers, list | str) and len(samplers) > bounds.samplers:
            raise _Costly(
                "samplers", f"samplers: {len(samplers)}, more than the {bounds.samplers} served"
            )
    except _Costly as costly:
        return costly.error
    except RecursionError:
        return FieldError("", "the request nests too deep to be read")
    return None


def costly_fields(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The fields of `body` whose cost grows per token beyond an ordinary request's: what the
    watchdog may blame for a stalled loop."""
    names = ("grammar", "json_schema", "response_format", "tools", "logit_bias",
             "dry_sequence_breakers")  # fmt: skip
    return tuple(n for n in names if body.get(n))
