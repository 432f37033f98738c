"""Constrained decoding in the engine, on the default model.

Every constrained output matches its grammar; unconstrained rows in the same
batch are untouched; a resumed request continues its grammar; a schema the
grammar engine cannot enforce is refused rather than relaxed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import llguidance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.llm_engine import LLMEngine
from shared.constraints import ConstraintError, check, grammar_of, lltokenizer
from shared.events import Finish, FinishReason, Text
from shared.sampling import SamplingParams, StructuredOutputs
from tests.engine.conftest import EngineFactory

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def chat(engine: LLMEngine, question: str) -> list[int]:
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return engine.tokenizer.tokenizer.encode(text).ids


def run_all(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], **resume: Any
) -> dict[str, tuple[list[int], str, Finish]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params, **resume)
    ids: dict[str, list[int]] = {name: [] for name in requests}
    text: dict[str, str] = dict.fromkeys(requests, "")
    finish: dict[str, Finish] = {}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, Text):
                ids[event.request_id] += event.token_ids
                text[event.request_id] += event.text
            elif isinstance(event, Finish):
                finish[event.request_id] = event
    return {name: (ids[name], text[name], finish[name]) for name in requests}


def constrained(spec: StructuredOutputs, **params: Any) -> SamplingParams:
    return SamplingParams(
        **{"max_tokens": 96, "temperature": 0.0, **params}, structured_outputs=spec
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(make_engine: EngineFactory, temperature: float) -> None:
    engine = make_engine()
    questions = ["Describe an administrator.", "Who is Ada?", "Invent a guest.", "A user, please."]
    requests = {
        f"r{i}": (
            chat(engine, q),
            constrained(StructuredOutputs(json=PERSON), seed=i, temperature=temperature),
        )
        for i, q in enumerate(questions)
    }
    for _, text, finish in run_all(engine, requests).values():
        assert finish.reason is FinishReason.STOP
        jsonschema.validate(json.loads(text), PERSON)


def test_regex_choice_grammar_and_json_object(make_engine: EngineFactory) -> None:
    engine = make_engine()
    lark = 'start: "Answer: " ANSWER "."\nANSWER: /[a-z]{2,8}/'
    specs = {
        "regex": StructuredOutputs(regex=r"[A-Z][a-z]+ \d{1,3}"),
        "choice": StructuredOutputs(choice=["red", "green", "dark blue"]),
        "grammar": StructuredOutputs(grammar=lark),
        "object": StructuredOutputs(json_object=True),
    }
    prompts = {name: chat(engine, "Name a colour and a number.") for name in specs}
    prompts["object"] = chat(engine, "Give me a JSON object describing a cat.")
    out = run_all(
        engine, {name: (prompts[name], constrained(spec)) for name, spec in specs.items()}
    )
    assert re.fullmatch(r"[A-Z][a-z]+ \d{1,3}", out["regex"][1])
    assert out["choice"][1] in specs["choice"].choice
    assert re.fullmatch(r"Answer: [a-z]{2,8}\.", out["grammar"][1])
    assert isinstance(json.loads(out["object"][1]), dict)
    assert all(finish.reason is FinishReason.STOP for _, _, finish in out.values())


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    free = {
        f"free{i}": (chat(engine, q), SamplingParams(max_tokens=40, temperature=0.0))
        for i, q in enumerate(["Tell me about cats.", "What is rain?"])
    }
    alone = run_all(make_engine(), free)
    mixed = run_all(
        engine,
        {
            **free,
            "json": (
                chat(engine, "A person as JSON."),
                constrained(StructuredOutputs(json=PERSON)),
            ),
            "choice": (
                chat(engine, "Yes or no?"),
                constrained(StructuredOutputs(choice=["yes", "no"])),
            ),
        },
    )
    for name in free:
        assert mixed[name][0] == alone[name][0]


def test_length_mid_object_returns_the_partial_text(make_engine: EngineFactory) -> None:
    engine = make_engine()
    params = constrained(StructuredOutputs(json=PERSON), max_tokens=5)
    ids, text, finish = run_all(engine, {"r": (chat(engine, "A person."), params)})["r"]
    assert finish.reason is FinishReason.LENGTH and len(ids) == 5
    assert text.startswith('{"name": "')


def test_logprobs_report_the_constrained_distribution(make_engine: EngineFactory) -> None:
    engine = make_engine()
    params = constrained(StructuredOutputs(choice=["yes", "no"]), logprobs=5)
    engine.add_request("r", chat(engine, "Is the sky green?"), params)
    logprobs = []
    while engine.has_unfinished():
        logprobs += [lp for e in engine.step() if isinstance(e, Text) for lp in e.logprobs or []]
    first = logprobs[0]
    allowed = [token for token, logprob in first.top if logprob > float("-inf")]
    words = {engine.tokenizer.tokenizer.decode([token]) for token in allowed}
    assert words <= {"yes", "no", "y", "n", "ye"}, words
    assert abs(sum(2.718281828**lp for _, lp in first.top if lp > -1e9) - 1.0) < 1e-3


@pytest.mark.parametrize("cut", [1, 6, 13])
def test_resumed_constrained_request_continues_to_the_same_object(
    make_engine: EngineFactory, cut: int
) -> None:
    engine = make_engine()
    prompt = chat(engine, "Describe a user.")
    params = constrained(StructuredOutputs(json=PERSON), temperature=1.0, seed=11)
    ids, text, _ = run_all(engine, {"whole": (prompt, params)})["whole"]
    emitted = engine.tokenizer.tokenizer.decode(ids[:cut])
    again, rest, finish = run_all(
        make_engine(),
        {"resumed": (prompt, params)},
        generated_token_ids=ids[:cut],
        emitted_chars=len(emitted),
    )["resumed"]
    assert ids[:cut] + again == ids
    assert finish.reason is FinishReason.STOP
    jsonschema.validate(json.loads(text), PERSON)


def test_a_repeated_grammar_is_compiled_once(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = chat(engine, "Pick one.")
    spec = StructuredOutputs(choice=["a", "b"])
    run_all(engine, {f"r{i}": (prompt, constrained(spec)) for i in range(3)})
    run_all(engine, {"again": (prompt, constrained(StructuredOutputs(choice=["a", "b"])))})
    assert engine.constraints.compiled == 1


def test_an_aborted_sequence_frees_its_matcher(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("r", chat(engine, "A person."), constrained(StructuredOutputs(json=PERSON)))
    engine.step()
    seq = engine.sequences["r"]
    assert seq.matcher is not None
    engine.abort("r")
    assert seq.matcher is None


# --- property: generated schemas -------------------------------------------------------------

_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda hi: {"type": "integer", "minimum": 0, "maximum": hi}, st.integers(1, 999)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
    st.lists(
        st.sampled_from(["alpha", "beta", "gamma", "delta"]), min_size=1, max_size=3, unique=True
    ).map(lambda options: {"enum": options}),
)
_names = st.sampled_from(["id", "name", "ok", "count", "kind", "note"])


def _object(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.dictionaries(_names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
            }
        )
    )


schemas = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda items: {"type": "array", "items": items, "maxItems": 2}, children),
    ),
    max_leaves=5,
).filter(lambda schema: schema.get("type") == "object")


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=schemas, seed=st.integers(0, 1000))
def test_every_output_of_a_generated_schema_validates(
    make_engine: EngineFactory, schema: dict, seed: int
) -> None:
    engine = make_engine()
    params = constrained(StructuredOutputs(json=schema), max_tokens=160, temperature=1.0, seed=seed)
    _, text, finish = run_all(engine, {"r": (chat(engine, "Fill in the form."), params)})["r"]
    if finish.reason is FinishReason.STOP:
        jsonschema.validate(json.loads(text), schema)


_unsupported = st.sampled_from(
    [
        {"if": {"type": "string"}},
        {"type": "string", "format": "no-such-format"},
        {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
        {"not": {"type": "string"}},
    ]
)


@settings(max_examples=8, deadline=None)
@given(extra=_unsupported, name=_names)
def test_a_schema_feature_that_cannot_be_enforced_is_refused(extra: dict, name: str) -> None:
    schema = {"type": "object", "properties": {name: extra}, "required": [name]}
    with pytest.raises(ConstraintError):
        check(grammar_of(StructuredOutputs(json=schema)), "json")


def test_the_grammar_tokenizer_accepts_the_model_vocabulary(make_engine: EngineFactory) -> None:
    engine = make_engine()
    tokenizer = lltokenizer(engine.tokenizer, engine.model_config.vocab_size)
    assert isinstance(tokenizer, llguidance.LLTokenizer)
    assert tokenizer.vocab_size == engine.model_config.vocab_size


def test_preempted_constrained_sequences_continue_their_grammar(
    make_engine: EngineFactory,
) -> None:
    """A preempted sequence's matcher is freed and rebuilt from its tokens: same outputs."""
    reference = make_engine()
    encode = reference.tokenizer.tokenizer.encode
    texts = [
        "The history of the Roman Empire begins with",
        "In a small village by the sea, there lived an old fisherman who",
        "Python is a programming language that",
        "My favourite recipe for apple pie needs flour, butter and",
    ]
    spec = StructuredOutputs(regex=r"[a-z]+( [a-z]+){6,12}")
    requests = {
        f"r{i}": (encode(text).ids, constrained(spec, max_tokens=14, temperature=1.0, seed=i))
        for i, text in enumerate(texts)
    }
    assert all(len(ids) + params.max_tokens <= 32 for ids, params in requests.values())
    expected = run_all(reference, requests)
    tight = make_engine(num_blocks=5)
    got = run_all(tight, requests)
    assert tight.stats.preemptions > 0
    for name, (ids, text, _) in expected.items():
        assert got[name][0] == ids
        assert (
            re.fullmatch(r"[a-z]+( [a-z]+){6,12}", text)
            or got[name][2].reason is FinishReason.LENGTH
        )
