"""Schema-constrained training prompts: random JSON schemas over everyday topics, each with a prompt
asking the target to describe the topic as a JSON object of that schema. Generated under the schema
(SamplingParams.json_schema, the device DFA), their responses put the head's training data where
constrained decoding runs: keys, punctuation and short values inside JSON structure (issue 15: τ
under a schema should approach τ without one).

    -> jsonl rows {"prompt": ..., "json_schema": {...}, "source": "schema"}

The schemas stay in the subset specjax.json_schema_regex puts on the device DFA (objects, strings,
bounded integers, numbers, booleans, enums, arrays of strings or of small objects, one level of
nesting), with random property names, order and required sets; the topics and fields are generic
(no film / cast schema like the one bench_engine measures with).
"""
from __future__ import annotations

import json
import random

TOPICS = ["a city", "a recipe", "a book", "a historical figure", "a planet", "a smartphone", "a hiking trail",
          "a restaurant", "a job posting", "a university course", "an animal species", "a software library",
          "a football club", "a museum", "a car model", "a board game", "a weather forecast", "a train route",
          "a medication", "a programming language", "a festival", "a mountain", "a startup company", "a song",
          "a chemical element", "a podcast episode", "a hotel", "a bicycle", "a painting", "a river",
          "an online order", "a customer complaint", "a bug report", "a conference talk", "a garden plant",
          "a space mission", "a video game", "a fitness workout", "a news article", "a bank transaction"]
STRING_FIELDS = ["name", "title", "description", "summary", "location", "country", "author", "category",
                 "owner", "language", "status", "color", "brand", "address", "notes", "origin", "type",
                 "headline", "reason", "contact_email", "website", "manufacturer", "region", "comment"]
INT_FIELDS = ["year", "age", "count", "rating", "population", "price", "duration_minutes", "quantity",
              "rank", "capacity", "height_m", "founded", "pages", "length_km", "score", "id"]
NUMBER_FIELDS = ["latitude", "longitude", "weight_kg", "temperature", "percentage", "distance", "amount"]
BOOL_FIELDS = ["available", "verified", "is_open", "active", "recommended", "in_stock", "urgent", "public"]
ENUMS = {"priority": ["low", "medium", "high"], "level": ["beginner", "intermediate", "advanced"],
         "sentiment": ["positive", "neutral", "negative"], "size": ["small", "medium", "large"],
         "season": ["spring", "summer", "autumn", "winter"], "mood": ["calm", "happy", "sad", "tense"]}
LIST_FIELDS = ["tags", "features", "ingredients", "keywords", "highlights", "steps", "languages", "members"]
OBJECT_FIELDS = ["contact", "location_details", "stats", "metadata", "origin_info", "details"]


def _leaf(rng: random.Random) -> tuple[str, dict]:
    kind = rng.choices(["string", "integer", "number", "boolean", "enum", "list"], [5, 3, 1, 2, 2, 2])[0]
    if kind == "string":
        return rng.choice(STRING_FIELDS), {"type": "string"}
    if kind == "integer":
        s = {"type": "integer"}
        if rng.random() < 0.5:
            lo = rng.choice([0, 1, 1900, 10])
            s.update(minimum=lo, maximum=lo + rng.choice([5, 10, 100, 200, 1000]))
        return rng.choice(INT_FIELDS), s
    if kind == "number":
        return rng.choice(NUMBER_FIELDS), {"type": "number"}
    if kind == "boolean":
        return rng.choice(BOOL_FIELDS), {"type": "boolean"}
    if kind == "enum":
        name = rng.choice(sorted(ENUMS))
        return name, {"enum": list(ENUMS[name])}
    s = {"type": "array", "items": {"type": "string"}}
    if rng.random() < 0.6:
        s.update(minItems=1, maxItems=rng.choice([3, 4, 5]))
    return rng.choice(LIST_FIELDS), s


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 2-6 properties (names unique), some of them required (all, often)."""
    props: dict[str, dict] = {}
    for _ in range(rng.randint(2, 6)):
        if depth == 0 and rng.random() < 0.15:
            name, s = rng.choice(OBJECT_FIELDS), random_schema(rng, depth + 1)
        elif depth == 0 and rng.random() < 0.08:
            name, s = "items", {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1,
                                "maxItems": rng.choice([2, 3])}
        else:
            name, s = _leaf(rng)
        props.setdefault(name, s)
    names = list(props)
    required = names if rng.random() < 0.7 else [n for n in names if rng.random() < 0.6] or names[:1]
    return {"type": "object", "properties": props, "required": required}


def schema_prompts(n: int, seed: int = 0) -> list[dict]:
    """n prompt rows, each with its own random schema over a random topic."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        schema = random_schema(rng)
        topic = rng.choice(TOPICS)
        ask = rng.choice(["Describe {t} as a JSON object that follows this schema:\n{s}",
                          "Return only JSON matching the schema below, about {t}.\n\nSchema: {s}",
                          "Create a realistic example of {t} in JSON with these fields:\n{s}",
                          "Fill in this JSON schema for {t}:\n{s}"])
        rows.append({"prompt": ask.format(t=topic, s=json.dumps(schema)), "json_schema": schema, "source": "schema"})
    return rows
