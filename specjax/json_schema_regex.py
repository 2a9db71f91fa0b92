r"""JSON schemas as regular expressions, so that schema-constrained requests run on the device DFA
(specjax.regex_dfa -> specjax.token_dfa -> specjax.dfa_routing) instead of the host grammar path.

`schema_regex(schema)` gives a pattern for ``compile_regex(pattern, xgrammar=True)`` whose language
is exactly that of the host path's grammar for the schema,
``xgrammar.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)``
(specjax.grammar.build_grammar), for the subset of JSON Schema below; any other schema raises
:class:`SchemaUnsupported` with the reason, and its requests keep the host path.

xgrammar's JSON under those options (its cpp/json_schema_converter.cc; checked against xgrammar
0.2.8 and 0.2.9 by tests/test_json_schema_dfa.py: same language, and the same token masks on SmolLM2's
vocabulary):

    layout      ", " between array items and between properties, ": " after a key, no other
                whitespace anywhere
    string      " ( [^\x00-\x1f"\\] | \\["\\/bfnrt] | \\u[0-9A-Fa-f]{4} )* "   (code points; the
                surrogates' 3-byte encodings too, as xgrammar: compile_regex(xgrammar=True))
    minLength / maxLength   " [^"\\\r\n]{min,max} ": no escapes, controls but CR / LF allowed
    format      date, time, date-time, uuid, ipv4: xgrammar's regexes (before the lengths)
    integer     0 | -?[1-9][0-9]*; with minimum / maximum / exclusiveMinimum / exclusiveMaximum
                (whole numbers; the stricter bound wins) the canonical integers of the range
    number      -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
    boolean, null   true | false, null
    enum, const the values serialised as picojson does (picojson_dumps): no whitespace, keys in
                their order, string escapes \" \\ \b \f \n \r \t and \u00xx for other controls
                and DEL, numbers as int64, else "%.f" for whole doubles up to 2^53, else "%.17g"
                (xgrammar 0.2.8) or the shortest of "%.15g" / "%.16g" / "%.17g" that reads back
                (0.2.9 on; the installed xgrammar is asked once: _xgrammar_spells_short)
    array       [ item (, item){minItems-1, maxItems-1} ], and [] where minItems is 0 (only []
                where maxItems is 0 or items is false)
    object      the properties in the schema's order (strict_mode: no others; SamplingParams keeps
                the order a request gives), each key its picojson string; each
                optional one may be left out, the first written is any property up to the first
                required one; {} too where "required" is empty (even naming no property)

Precedence, as in xgrammar (the later keywords are then ignored): $ref, const, enum, anyOf, oneOf
(a union, like anyOf), allOf (of one schema), type (a list: the union of the schema under each
type), then properties / additionalProperties -> object, items -> array. $ref: a JSON pointer
into the root ("#/...", its parts taken as written, as xgrammar does), not recursive.

Unsupported (SchemaUnsupported): any JSON value (no type; {"type": "object"} or {"type": "array"}
alone; true), recursive $ref, additionalProperties other than false, patternProperties,
propertyNames, unevaluated*, min/maxProperties, prefixItems, contains, uniqueItems, pattern, other
formats, number bounds, multipleOf, allOf of several schemas, empty anyOf / oneOf, not / if / then /
else, $id, and every keyword not named here. The DFA's size is the caller's limit (compile_regex's
max_states, specjax.dfa_routing).
"""
from __future__ import annotations

import functools
import json
import math
import re

__all__ = ["SchemaUnsupported", "int_range_regex", "picojson_dumps", "schema_regex"]

ANNOTATIONS = frozenset({"title", "default", "description", "examples", "deprecated", "readOnly", "writeOnly",
                         "$comment", "$schema"})  # ignored, as by xgrammar
STRING = r'"(?:[^\x00-\x1f"\\]|\\(?:["\\/bfnrt]|u[0-9A-Fa-f]{4}))*"'
INTEGER = "(?:0|-?[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
LENGTH_CHAR = r'[^"\\\r\n]'  # a character of a string with minLength / maxLength
FORMATS = {  # xgrammar's regexes for these formats (JSONFormatToRegexPattern), without ^ and $
    "date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[1-2]\d|3[01])",
    "time": r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)",
    "date-time": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[1-2]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)"
                 r"(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)",
    "uuid": r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}",
    "ipv4": r"((25[0-5]|2[0-4]\d|[0-1]?\d?\d)\.){3}(25[0-5]|2[0-4]\d|[0-1]?\d?\d)",
}
# keywords of each type: the ones converted, and the ones that make the schema unsupported
TYPE_KEYS = {
    "integer": ({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}, {"multipleOf"}),
    "number": (set(), {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "string": ({"minLength", "maxLength", "format"}, {"pattern", "contentEncoding", "contentMediaType"}),
    "boolean": (set(), set()),
    "null": (set(), set()),
    "array": ({"items", "minItems", "maxItems"},
              {"prefixItems", "unevaluatedItems", "contains", "minContains", "maxContains", "uniqueItems"}),
    "object": ({"properties", "required", "additionalProperties"},
               {"patternProperties", "propertyNames", "unevaluatedProperties", "minProperties", "maxProperties",
                "dependentRequired", "dependentSchemas"}),
}
KNOWN = ANNOTATIONS | {"type", "$defs", "definitions"} | {k for a, b in TYPE_KEYS.values() for k in a | b}
INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_CHARS = 1 << 20  # longer regexes are unsupported (their DFAs would exceed any device limit anyway)


class SchemaUnsupported(ValueError):
    """The schema (or a part of it) is outside the subset converted to a regex (see the module)."""


def schema_regex(schema: dict | str) -> str:
    """The regex of a JSON schema (a dict, or its JSON text as the host path receives it): see the
    module. Raises SchemaUnsupported, or ValueError for text that is not JSON."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    if not isinstance(schema, dict):
        raise SchemaUnsupported(f"a schema must be a JSON object, got {type(schema).__name__}")
    out = _Converter(schema).convert(schema, "#")
    if len(out) > MAX_CHARS:
        raise SchemaUnsupported(f"the regex exceeds {MAX_CHARS} characters")
    return out


# ----------------------------------------------------------------------------- literals

_PICO_ESCAPES = {ord('"'): b'\\"', ord("\\"): b"\\\\", 8: b"\\b", 12: b"\\f", 10: b"\\n", 13: b"\\r", 9: b"\\t"}


def _pico_str(s: str) -> str:
    """A string as picojson serialises it (byte by byte over its UTF-8)."""
    out = bytearray(b'"')
    for b in s.encode("utf-8", "surrogatepass"):
        out += _PICO_ESCAPES.get(b) or (b"\\u%04x" % b if b < 0x20 or b == 0x7F else bytes([b]))
    return (bytes(out) + b'"').decode("utf-8", "surrogatepass")


def _spell_double(x: float, short: bool) -> str:
    """A double as xgrammar writes it in const / enum: whole values up to 2^53 as integers; other values
    "%.17g" (xgrammar 0.2.8), or (short, from 0.2.9 on) the first of "%.15g", "%.16g", "%.17g" that
    reads back as the same double (0.1 -> "0.1", 1e300 -> "1e+300" instead of
    "0.10000000000000001", "1.0000000000000001e+300")."""
    if abs(x) <= 2.0 ** 53 and x.is_integer():
        return "%.f" % x
    for digits in ((15, 16) if short else ()):
        text = "%.*g" % (digits, x)
        if float(text) == x:
            return text
    return "%.17g" % x


@functools.cache
def _xgrammar_spells_short() -> bool:
    """Whether the installed xgrammar writes const / enum doubles in their short form (_spell_double):
    asked once, by compiling {"const": 0.1}, so that the device DFA's language stays the host path's
    with either spelling. Without xgrammar: the long form ("%.17g", the pinned versions')."""
    try:
        import xgrammar
    except ImportError:
        return False
    info = xgrammar.TokenizerInfo(["a"], vocab_size=1, stop_token_ids=[0])
    grammar = xgrammar.Grammar.from_json_schema('{"const": 0.1}', any_whitespace=False, strict_mode=True)
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info, max_threads=1).compile_grammar(grammar))
    return bool(matcher.accept_string(b"0.1") and matcher.is_completed())


def picojson_dumps(v) -> str:
    """A JSON value (from json.loads) as xgrammar writes it for const / enum (picojson's serialize)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int) and INT64[0] <= v <= INT64[1]:
        return str(v)
    if isinstance(v, (int, float)):
        try:
            x = float(v)
        except OverflowError:
            raise SchemaUnsupported(f"the number {v} is out of a double's range") from None
        if not math.isfinite(x):
            raise SchemaUnsupported(f"the number {v} is not finite")
        return _spell_double(x, _xgrammar_spells_short())
    if isinstance(v, str):
        return _pico_str(v)
    if isinstance(v, list):
        return "[" + ",".join(picojson_dumps(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(picojson_dumps(k) + ":" + picojson_dumps(x) for k, x in v.items()) + "}"
    raise SchemaUnsupported(f"not a JSON value: {v!r}")


def _lit(text: str) -> str:
    """A regex matching exactly text (control characters as \\xHH)."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 0x20 or ord(c) == 0x7F else re.escape(c) for c in text)


def _alt(items: list[str]) -> str:
    return items[0] if len(items) == 1 else "(?:" + "|".join(items) + ")"


# ----------------------------------------------------------------------------- integer ranges

def _digits_range(x: str, y: str) -> str:
    """Strings of len(x) == len(y) digits from x to y (x <= y), leading zeros allowed."""
    if x == y:
        return x
    n = len(x)
    if x[1:] == "0" * (n - 1) and y[1:] == "9" * (n - 1):
        return f"[{x[0]}-{y[0]}]" + ("[0-9]" + (f"{{{n - 1}}}" if n > 2 else "") if n > 1 else "")
    if x[0] == y[0]:
        return x[0] + _digits_range(x[1:], y[1:])
    parts = [x[0] + _digits_range(x[1:], "9" * (n - 1))]
    if int(y[0]) - int(x[0]) > 1:
        parts.append(f"[{int(x[0]) + 1}-{int(y[0]) - 1}]" + f"[0-9]{{{n - 1}}}")
    parts.append(y[0] + _digits_range("0" * (n - 1), y[1:]))
    return "(?:" + "|".join(parts) + ")"


def _positive_range(a: int, b: int | None) -> list[str]:
    """Alternatives spelling the integers a..b (1 <= a, b None: unbounded) without leading zeros."""
    if b is not None and a > b:
        return []
    out = []
    top = len(str(b)) if b is not None else len(str(a))
    for n in range(len(str(a)), top + 1):
        lo, hi = max(a, 10 ** (n - 1)), min(b, 10 ** n - 1) if b is not None else 10 ** n - 1
        out.append(_digits_range(str(lo), str(hi)))
    if b is None:
        out.append(f"[1-9][0-9]{{{top},}}")
    return out


def int_range_regex(lo: int | None, hi: int | None) -> str:
    """The canonical decimal integers (no leading zeros, no -0) from lo to hi (None: unbounded)."""
    parts = []
    if lo is None or lo < 0:  # negatives: "-" and a magnitude in [max(1, -hi), -lo]
        neg = _positive_range(max(1, -hi) if hi is not None else 1, -lo if lo is not None else None)
        if neg:
            parts.append("-" + _alt(neg))
    if (lo is None or lo <= 0) and (hi is None or hi >= 0):
        parts.append("0")
    parts += _positive_range(max(1, lo) if lo is not None else 1, hi)
    if not parts:
        raise SchemaUnsupported(f"the integer range [{lo}, {hi}] is empty")
    return _alt(parts)


# ----------------------------------------------------------------------------- schemas

class _Converter:
    """Recursive conversion (see the module); refs: the $ref pointers being expanded."""

    def __init__(self, root: dict):
        self.root = root
        self.refs: list[str] = []
        self.done: dict[str, str] = {}  # the regex of each $ref pointer converted

    def convert(self, s, where: str) -> str:
        if s is True or (isinstance(s, dict) and not set(s) - ANNOTATIONS):
            raise SchemaUnsupported(f"{where}: any JSON value (a recursive grammar)")
        if not isinstance(s, dict):
            raise SchemaUnsupported(f"{where}: the schema {json.dumps(s)} is not an object")
        if "$ref" in s:
            return self.ref(s["$ref"], where)
        if "const" in s:
            return _lit(picojson_dumps(s["const"]))
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise SchemaUnsupported(f"{where}: enum must be a non-empty list")
            return _alt([_lit(picojson_dumps(v)) for v in s["enum"]])
        for key in ("anyOf", "oneOf"):
            if key in s:
                opts = s[key]
                if not isinstance(opts, list) or not opts:
                    raise SchemaUnsupported(f"{where}: {key} must be a non-empty list")
                return _alt([self.convert(o, f"{where}/{key}/{i}") for i, o in enumerate(opts)])
        if "allOf" in s:
            if not isinstance(s["allOf"], list) or len(s["allOf"]) != 1:
                raise SchemaUnsupported(f"{where}: allOf of several schemas")
            return self.convert(s["allOf"][0], f"{where}/allOf/0")
        unknown = sorted(set(s) - KNOWN)
        if unknown:
            raise SchemaUnsupported(f"{where}: keywords {unknown} not supported on the device")
        t = s.get("type")
        if isinstance(t, list):
            if not t:
                return self.convert({k: v for k, v in s.items() if k != "type"}, where)
            return _alt([self.convert({**s, "type": x}, f"{where}[type={x}]") for x in t])
        if t is None:
            if {"properties", "additionalProperties"} & set(s):
                t = "object"
            elif "items" in s:
                t = "array"
            else:
                raise SchemaUnsupported(f"{where}: no type (any JSON value: a recursive grammar)")
        if not isinstance(t, str) or t not in TYPE_KEYS:
            raise SchemaUnsupported(f"{where}: type {t!r}")
        bad = sorted(set(s) & TYPE_KEYS[t][1])
        if bad:
            raise SchemaUnsupported(f"{where}: {t} with {bad}")
        return getattr(self, "t_" + t)(s, where)

    def ref(self, uri, where: str) -> str:
        if not isinstance(uri, str) or not uri.startswith("#/"):
            raise SchemaUnsupported(f"{where}: $ref {uri!r} (only '#/...' pointers into the schema)")
        if uri in self.refs:
            raise SchemaUnsupported(f"{where}: recursive $ref {uri!r}")
        if uri in self.done:
            return self.done[uri]
        node = self.root
        for part in (p for p in uri[2:].split("/") if p):  # as xgrammar: parts as written (no ~0 ~1)
            if not isinstance(node, dict) or part not in node:
                raise SchemaUnsupported(f"{where}: $ref {uri!r} not found")
            node = node[part]
        self.refs.append(uri)
        try:
            self.done[uri] = out = self.convert(node, uri)
        finally:
            self.refs.pop()
        if len(out) > MAX_CHARS:  # (refs used several times at each level: exponential text)
            raise SchemaUnsupported(f"{where}: the regex exceeds {MAX_CHARS} characters")
        return out

    # the types: s holds the type's keywords (others ignored, as by xgrammar)

    def t_integer(self, s, where):
        def whole(k):
            v = s[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != math.floor(v):
                raise SchemaUnsupported(f"{where}: {k} {v!r} is not a whole number")
            v = int(v)
            if not INT64[0] <= v <= INT64[1]:
                raise SchemaUnsupported(f"{where}: {k} {v} out of int64")
            return v
        lows = [whole("minimum")] if "minimum" in s else []
        lows += [whole("exclusiveMinimum") + 1] if "exclusiveMinimum" in s else []
        highs = [whole("maximum")] if "maximum" in s else []
        highs += [whole("exclusiveMaximum") - 1] if "exclusiveMaximum" in s else []
        if not lows and not highs:
            return INTEGER
        return int_range_regex(max(lows) if lows else None, min(highs) if highs else None)

    def t_number(self, s, where):
        return NUMBER

    def t_boolean(self, s, where):
        return "(?:true|false)"

    def t_null(self, s, where):
        return "null"

    def t_string(self, s, where):
        if "format" in s:
            if s["format"] not in FORMATS:
                raise SchemaUnsupported(f"{where}: string format {s['format']!r}")
            return f'"(?:{FORMATS[s["format"]]})"'
        lo, hi = s.get("minLength", 0), s.get("maxLength", -1)
        for v in (lo, hi):
            if isinstance(v, bool) or not isinstance(v, int):
                raise SchemaUnsupported(f"{where}: string length {v!r} is not an integer")
        if lo == 0 and hi == -1:
            return STRING
        if lo < 0 or hi < -1 or (hi >= 0 and lo > hi):
            raise SchemaUnsupported(f"{where}: string lengths {lo}..{hi}")
        return f'"{LENGTH_CHAR}{{{lo},{hi if hi >= 0 else ""}}}"'

    def t_array(self, s, where):
        if "items" not in s:  # {"type": "array"}: any array; with other keywords xgrammar's strict quirks
            raise SchemaUnsupported(f"{where}: array without items")
        lo, hi = s.get("minItems", 0), s.get("maxItems", -1)
        for v in (lo, hi):
            if isinstance(v, bool) or not isinstance(v, int):
                raise SchemaUnsupported(f"{where}: array length {v!r} is not an integer")
        lo = max(0, lo)
        if hi < -1 or (hi >= 0 and lo > hi):
            raise SchemaUnsupported(f"{where}: array lengths {lo}..{hi}")
        if s["items"] is False or hi == 0:
            if lo > 0:
                raise SchemaUnsupported(f"{where}: minItems {lo} with no items allowed")
            return r"\[\]"
        item = self.convert(s["items"], f"{where}/items")
        rest = f"{{{max(lo - 1, 0)},{hi - 1 if hi >= 0 else ''}}}"
        nonempty = rf"\[{item}(?:, {item}){rest}\]"
        return f"(?:{nonempty}|\\[\\])" if lo == 0 else nonempty

    def t_object(self, s, where):
        extra = s.get("additionalProperties", False)
        if extra is not False:
            raise SchemaUnsupported(f"{where}: additionalProperties {json.dumps(extra)} (only false)")
        props = s.get("properties")
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaUnsupported(f"{where}: required must be a list of strings")
        if props is None and set(s) - ANNOTATIONS == {"type"}:
            raise SchemaUnsupported(f"{where}: any object (a recursive grammar)")
        if not isinstance(props, dict) and props is not None:
            raise SchemaUnsupported(f"{where}: properties must be an object")
        if not props:
            return r"\{\}"
        names = list(props)
        pats = [_lit(picojson_dumps(k)) + ": " + self.convert(props[k], f"{where}/properties/{k}") for k in names]
        req = [k in required for k in names]
        tails = [""] * len(names)  # tails[i]: the properties after i
        for i in range(len(names) - 2, -1, -1):
            nxt = f", {pats[i + 1]}"
            tails[i] = (nxt if req[i + 1] else f"(?:{nxt})?") + tails[i + 1]
        firsts = []
        for i in range(len(names)):
            firsts.append(pats[i] + tails[i])
            if req[i]:
                break
        body = r"\{" + _alt(firsts) + r"\}"
        return f"(?:{body}|\\{{\\}})" if not required else body
