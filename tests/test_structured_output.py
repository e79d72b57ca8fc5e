"""Structured output: response_format json_object / json_schema enforced by constrained decoding
(llguidance), on both backends, through the real server and the OpenAI SDK. The demo model, sampled
at temperature 1 with 20 seeds: every reply parses and validates."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from localheap.heap import HeapConfig  # noqa: E402
from localheap.server import ServerSettings, create_app  # noqa: E402
from localheap.server.testing import ServerThread  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}}}}


def _backends():
    out = [pytest.param("torch", id="torch")]
    try:
        import mlx.core  # noqa: F401
        out.append(pytest.param("mlx", id="mlx"))
    except ImportError:
        out.append(pytest.param("mlx", id="mlx", marks=pytest.mark.skip(reason="mlx is not installed")))
    return out


@pytest.fixture(scope="module", params=_backends())
def client(request, torch_one_thread):
    from localheap.models import load_backend

    app = create_app(load_backend("demo", request.param), ServerSettings(heap=HeapConfig(budget=256), web_dir=None))
    with ServerThread(app) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        c.model_id = c.models.list().data[0].id
        yield c


def _ask(client, response_format, seed, **kw):
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(
        model=client.model_id, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=response_format, seed=seed, **{"temperature": 1.0, **kw})


def test_json_schema_20_of_20_parse_and_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ok = 0
    for seed in range(20):
        r = _ask(client, fmt, seed)
        assert r.choices[0].finish_reason == "stop", r   # the grammar ends the reply, not max_tokens
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        ok += 1
    assert ok == 20


def test_json_object_parses_streamed_and_not(client):
    """Any object: unbounded, so a random model's long string may run into max_tokens ("length");
    every reply the grammar ended ("stop") is an object."""
    stops = 0
    for seed in range(8):
        r = _ask(client, {"type": "json_object"}, seed, max_tokens=400)
        text = r.choices[0].message.content
        assert text.startswith("{")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            stops += 1
    assert stops >= 4
    chunks = list(_ask(client, {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, 3,
                       stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_an_unenforceable_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}, 0)
    assert e.value.status_code == 400 and "schema" in e.value.message


def test_the_sdk_parse_helper_gets_a_validated_object(client):
    """openai's own structured-output helper (a pydantic model as response_format, strict schema)."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=10)
        population: int = Field(ge=0, le=10_000_000)

    for seed in range(3):
        r = client.chat.completions.parse(model=client.model_id, messages=[{"role": "user", "content": "A city."}],
                                          response_format=City, temperature=1.0, seed=seed, max_tokens=60)
        city = r.choices[0].message.parsed
        assert isinstance(city, City) and 0 <= city.population <= 10_000_000
