"""Per-request sampling parameters, validated at construction."""
from __future__ import annotations

import dataclasses
import json
import math

MAX_LOGPROBS = 20
CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar", "choice")  # structured-output options, at most one


class SamplingParamsError(ValueError):
    """Out-of-range or ill-typed sampling parameters."""


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    json_schema: dict | str | None = None  # a JSON schema (dict, or a string holding a JSON object)
    regex: str | None = None  # the output must match this regular expression
    grammar: str | None = None  # the output must match this EBNF grammar (root rule `root`)
    choice: list[str] | None = None  # the output must be exactly one of these strings
    repetition_penalty: float = 1.0  # > 0; 1 = off. Prompt and output tokens: logit / r if > 0, else * r
    frequency_penalty: float = 0.0  # in [-2, 2]; logit -= f * (count of the token in the output)
    presence_penalty: float = 0.0  # in [-2, 2]; logit -= p if the token occurs in the output

    def __post_init__(self):
        def bad(msg):
            raise SamplingParamsError(f"invalid SamplingParams: {msg}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not (0.0 <= self.temperature < float("inf")):
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be an integer >= 0 (or -1 for off), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        self._check_penalties()
        self._check_constraint()

    def _check_penalties(self) -> None:
        def number(name, ok, rule):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                _invalid(f"{name} must be {rule}, got {v!r}")
            setattr(self, name, float(v))
        number("repetition_penalty", lambda v: v > 0, "a finite number > 0 (1 = off)")
        for name in ("frequency_penalty", "presence_penalty"):
            number(name, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0 = off)")

    def _check_constraint(self) -> None:
        """Types of the structured-output fields; their content is checked by specjax.grammar."""
        given = [f for f in CONSTRAINT_FIELDS if getattr(self, f) is not None]
        if len(given) > 1:
            _invalid(f"at most one of {', '.join(CONSTRAINT_FIELDS)} may be set, got {' and '.join(given)}")
        if self.json_schema is not None:
            _schema_text(self.json_schema)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                _invalid(f"{name} must be a non-empty string or None, got {v!r}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)) \
                    or not self.choice:
                _invalid(f"choice must be a non-empty list of strings or None, got {self.choice!r}")
            self.choice = list(self.choice)
            if any(not isinstance(c, str) or not c for c in self.choice):
                _invalid(f"choice must hold non-empty strings, got {self.choice!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any of the repetition / frequency / presence penalties is on."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def constraint(self) -> tuple[str, str] | None:
        """None, or a hashable ``(field name, canonical text)`` key of the output constraint.

        Equal constraints give equal keys (a schema is re-serialised: a dict and its JSON text, however
        spaced, give one key; its keys keep their order, which is the generated properties' order), so
        the key can index a cache of compiled grammars.
        """
        if self.json_schema is not None:
            return ("json_schema", _schema_text(self.json_schema))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.grammar is not None:
            return ("grammar", self.grammar)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice, ensure_ascii=False))
        return None


def _invalid(msg: str):
    raise SamplingParamsError(f"invalid SamplingParams: {msg}")


def _schema_text(schema) -> str:
    """JSON text of a schema given as a dict or as a string holding a JSON object, its keys in the
    order given: properties are generated in the schema's order (as xgrammar builds the grammar),
    so the text must not reorder them (sorted keys made every object alphabetical)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            _invalid(f"json_schema is not valid JSON: {e}")
    if not isinstance(schema, dict):
        _invalid(f"json_schema must be a JSON object (dict or JSON string), got {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        _invalid(f"json_schema is not JSON-serialisable: {e}")
