"""Preparation: model resolution, max_tokens rules and messages, thinking defaults, options.

A minimal protocol (defined here) feeds ``prepare`` so that these tests pin
preparation's behaviour, not a real protocol's parsing. The tokenizer is the
default model's, read from its GGUF (no weights are loaded).
"""

from __future__ import annotations

import base64
from typing import Any

import llguidance
import pytest
from pydantic import BaseModel

from api.backends.base import ServedModel
from api.errors import ApiError, bad_request
from api.output_parser import HERMES_TOOL_CALL, THINK
from api.preparation import (
    DEFAULT_MAX_TOKENS,
    MAX_EFFORT_MAX_TOKENS,
    THINKING_MAX_TOKENS,
    PreparationContext,
    encode_request,
    parsing_options,
    prepare,
    resolve_max_tokens,
    thinking_mode,
)
from api.protocols.base import GenerationRequest, Protocol, ResponseBuilder
from bench.vision_model import make_idefics3
from shared.constraints import lltokenizer
from shared.conversation import (
    AssistantMessage,
    Conversation,
    ResponseFormat,
    TextPart,
    Tool,
    ToolChoice,
    UserMessage,
)
from shared.images.loading import load_image_processing
from shared.registry import ModelRegistry, ModelSpec, UnknownModel, default_registry
from shared.sampling import StructuredOutputs
from shared.tokenizer_loader import load_tokenizer
from shared.wire import PreparedRequest
from tests.image_server import png_bytes

CONTEXT = 512


def _parse(body: dict[str, Any]) -> GenerationRequest:
    """Just enough of a protocol: text messages, a few options, no validation of its own."""
    if "model" not in body:
        raise bad_request("model is required", "model")
    conversation = Conversation(
        messages=[UserMessage([TextPart(text)]) for text in body.get("messages", ["Hi"])],
        tools=[tool if isinstance(tool, Tool) else Tool(tool) for tool in body.get("tools", [])],
        tool_choice=ToolChoice(
            body.get("tool_choice", "auto"), body.get("tool_name"), body.get("parallel", True)
        ),
        thinking=body.get("thinking"),
        reasoning_effort=body.get("reasoning_effort"),
        response_format=body.get("response_format", ResponseFormat()),
    )
    return GenerationRequest(
        model=body["model"],
        conversation=conversation,
        max_tokens=body.get("max_tokens"),
        temperature=body.get("temperature"),
        stop=body.get("stop", []),
        structured_outputs=body.get("structured_outputs"),
    )


def _no_builder(request: GenerationRequest, context: Any) -> ResponseBuilder:
    raise AssertionError("preparation never builds responses")


MINIMAL = Protocol(
    name="minimal",
    path="/v1/minimal",
    id_prefix="min-",
    parse=_parse,
    builder=_no_builder,
    error_body=lambda error: {"error": error.message},
    request_model=BaseModel,
)


@pytest.fixture(scope="module")
def default_spec() -> ModelSpec:
    return default_registry().resolve("default")


@pytest.fixture(scope="module")
def ctx(default_spec: ModelSpec) -> PreparationContext:
    return _context(default_spec)


def _context(spec: ModelSpec, context_length: int = CONTEXT) -> PreparationContext:
    served = ServedModel(
        spec, load_tokenizer(default_registry().resolve("default").tokenizer), context_length
    )
    return PreparationContext(ModelRegistry([spec]), {spec.name: served})


def _qwen3_like(capabilities: tuple[str, ...] = ()) -> ModelSpec:
    """The default model's files under the qwen3 prompt format: a model that thinks."""
    base = default_registry().resolve("default")
    return ModelSpec("thinker", base.weights, prompt_format="qwen3", capabilities=capabilities)


def _error(call: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as raised:
        call(*args, **kwargs)
    return raised.value


# --- max_tokens ------------------------------------------------------------------


def test_requested_max_tokens_is_kept_when_it_fits():
    assert resolve_max_tokens(100, 400, 500) == 100
    assert resolve_max_tokens(1, 499, 500) == 1


def test_requested_max_tokens_over_the_context_is_a_400_with_openais_message():
    error = _error(resolve_max_tokens, 200, 400, 500, param="max_completion_tokens")
    assert error.status == 400
    assert error.param == "max_completion_tokens"
    assert error.message == (
        "This model's maximum context length is 500 tokens. However, you requested 600 tokens "
        "(400 in the messages, 200 in the completion). Please reduce the length of the "
        "messages or completion."
    )


def test_unset_max_tokens_defaults_by_mode_and_is_clamped_to_the_context():
    big = 1_000_000
    assert resolve_max_tokens(None, 10, big) == DEFAULT_MAX_TOKENS == 8192
    assert resolve_max_tokens(None, 10, big, thinking=True) == THINKING_MAX_TOKENS == 65536
    assert resolve_max_tokens(None, 10, big, thinking=True, max_effort=True) == 131072
    assert MAX_EFFORT_MAX_TOKENS == 131072
    assert resolve_max_tokens(None, 10, big, max_effort=True) == 8192  # effort needs thinking
    assert resolve_max_tokens(None, 400, 500) == 100
    assert resolve_max_tokens(None, 499, 500) == 1


@pytest.mark.parametrize("prompt_tokens", [500, 501])
def test_a_prompt_that_fills_the_context_is_a_400(prompt_tokens: int):
    error = _error(resolve_max_tokens, None, prompt_tokens, 500)
    assert error.status == 400
    assert error.message == (
        f"This model's maximum context length is 500 tokens. However, your messages resulted "
        f"in {prompt_tokens} tokens. Please reduce the length of the messages."
    )


def test_prepare_reports_overflow_with_the_real_prompt_length(ctx: PreparationContext):
    prompt_tokens = len(encode_request(_parse({"model": "default"}), ctx).token_ids)
    error = _error(prepare, MINIMAL, {"model": "default", "max_tokens": CONTEXT}, ctx)
    assert error.message.startswith(
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        f"{prompt_tokens + CONTEXT} tokens ({prompt_tokens} in the messages, {CONTEXT} in the "
        "completion)."
    )


# --- models ------------------------------------------------------------------------


def test_unknown_model_is_a_400_with_the_registrys_message(ctx: PreparationContext):
    with pytest.raises(UnknownModel) as registry_error:
        ctx.registry.resolve("gpt-4o")
    error = _error(prepare, MINIMAL, {"model": "gpt-4o"}, ctx)
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", "model")
    assert error.message == str(registry_error.value)
    assert error.message == (
        "The supported API model names are default, smollm2-135m-instruct, but you passed gpt-4o."
    )


def test_a_local_path_is_not_a_model_name_over_http(
    ctx: PreparationContext, default_spec, tmp_path
):
    """A path that exists and one that does not get the same answer: no file-existence oracle."""
    existing = _error(prepare, MINIMAL, {"model": str(default_spec.weights)}, ctx)
    missing = _error(prepare, MINIMAL, {"model": str(tmp_path / "none.gguf")}, ctx)
    assert (existing.status, existing.param, existing.code) == (400, "model", "model_not_found")
    assert (missing.status, missing.param, missing.code) == (400, "model", "model_not_found")
    assert existing.message.replace(str(default_spec.weights), "?") == missing.message.replace(
        str(tmp_path / "none.gguf"), "?"
    )


def test_aliases_resolve_to_the_registry_name(ctx: PreparationContext):
    prepared = prepare(MINIMAL, {"model": "default", "max_tokens": 5}, ctx)
    assert prepared.wire.model == "smollm2-135m-instruct"
    assert prepared.context.model == "default"  # responses echo the client's name


# --- the prepared request ------------------------------------------------------------


def test_prepare_builds_the_wire_request(ctx: PreparationContext):
    body = {"model": "default", "messages": ["Hello"], "max_tokens": 7, "stop": ["\n"]}
    prepared = prepare(MINIMAL, body, ctx)
    wire = prepared.wire
    assert wire.request_id == prepared.context.request_id
    assert wire.request_id.startswith("min-")
    encoded = encode_request(prepared.request, ctx)
    assert wire.prompt_token_ids == encoded.token_ids
    assert "<|im_start|>user\nHello<|im_end|>" in encoded.rendered.prompt
    assert wire.sampling.max_tokens == 7
    assert wire.sampling.temperature == 1.0  # OpenAI's default when unset
    assert wire.sampling.stop == ["\n"]
    assert wire.parsing.reasoning is None and wire.parsing.tool_calls is None
    assert prepared.context.system_fingerprint.startswith("fp_")
    assert PreparedRequest.from_dict(wire.to_dict()) == wire


def test_unset_max_tokens_is_clamped_by_prepare(ctx: PreparationContext):
    prepared = prepare(MINIMAL, {"model": "default"}, ctx)
    assert prepared.wire.sampling.max_tokens == CONTEXT - len(prepared.wire.prompt_token_ids)


def test_a_bad_sampling_value_is_a_400_naming_the_field(ctx: PreparationContext):
    error = _error(prepare, MINIMAL, {"model": "default", "temperature": -1}, ctx)
    assert (error.status, error.param) == (400, "temperature")
    assert error.message == "temperature must be >= 0, got -1"


def test_a_conversation_the_format_cannot_express_is_a_400(ctx: PreparationContext):
    error = _error(prepare, MINIMAL, {"model": "default", "messages": []}, ctx)
    assert error.status == 400
    assert "messages" in error.message


# --- thinking and parsing options ----------------------------------------------------


def test_thinking_is_on_by_default_only_for_models_that_think(default_spec: ModelSpec):
    unset, on, off = (
        Conversation([]),
        Conversation([], thinking=True),
        Conversation([], thinking=False),
    )
    assert not thinking_mode(unset, default_spec)
    assert not thinking_mode(on, default_spec)  # a model that cannot think is not asked to
    thinker = _qwen3_like()
    assert thinking_mode(unset, thinker) and thinking_mode(on, thinker)
    assert not thinking_mode(off, thinker)
    jinja_thinker = ModelSpec("j", default_spec.weights, capabilities=("thinking",))
    assert thinking_mode(unset, jinja_thinker)


def test_thinking_mode_defaults_max_tokens_and_parses_reasoning():
    ctx = _context(_qwen3_like(), context_length=1_000_000)
    prepared = prepare(MINIMAL, {"model": "thinker"}, ctx)
    assert prepared.wire.sampling.max_tokens == THINKING_MAX_TOKENS
    assert prepared.wire.parsing.reasoning == (THINK.open, THINK.close)
    assert not prepared.wire.parsing.starts_in_reasoning
    effort = prepare(MINIMAL, {"model": "thinker", "reasoning_effort": "max"}, ctx)
    assert effort.wire.sampling.max_tokens == MAX_EFFORT_MAX_TOKENS
    off = prepare(MINIMAL, {"model": "thinker", "thinking": False}, ctx)
    assert off.wire.sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert off.wire.parsing.reasoning is None


def test_a_prompt_that_opens_reasoning_starts_the_parser_inside_it():
    ctx = _context(_qwen3_like())
    conversation = Conversation(
        [
            UserMessage([TextPart("Think about <think> tags")]),
            AssistantMessage(reasoning="Let me see", prefix=True),
        ]
    )
    encoded = encode_request(GenerationRequest("thinker", conversation), ctx)
    assert encoded.rendered.prompt.endswith("<think>\nLet me see")
    assert parsing_options(encoded, thinking=True).starts_in_reasoning
    plain = Conversation([UserMessage([TextPart("Is <think> a tag?")])])
    encoded = encode_request(GenerationRequest("thinker", plain), ctx)
    assert not parsing_options(encoded, thinking=True).starts_in_reasoning


def test_tool_call_markup_is_parsed_only_when_tools_may_be_called(ctx: PreparationContext):
    with_tools = prepare(MINIMAL, {"model": "default", "tools": ["get_weather"]}, ctx)
    assert with_tools.wire.parsing.tool_calls == (HERMES_TOOL_CALL.open, HERMES_TOOL_CALL.close)
    assert with_tools.parser_config.tool_calls == HERMES_TOOL_CALL
    body = {"model": "default", "tools": ["get_weather"], "tool_choice": "none"}
    assert prepare(MINIMAL, body, ctx).wire.parsing.tool_calls is None
    assert prepare(MINIMAL, {"model": "default"}, ctx).wire.parsing.tool_calls is None


def test_one_tool_call_per_turn_reaches_the_parser(ctx: PreparationContext):
    body = {"model": "default", "tools": ["get_weather"], "parallel": False}
    single = prepare(MINIMAL, body, ctx)
    assert single.wire.parsing.single_tool_call and single.parser_config.single_tool_call
    assert not prepare(MINIMAL, {**body, "parallel": True}, ctx).wire.parsing.single_tool_call
    assert not prepare(MINIMAL, {**body, "tool_choice": "none"}, ctx).wire.parsing.single_tool_call


def _image_body(model: str) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    image = {"type": "image_url", "image_url": {"url": url}}
    return {
        "model": model,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}],
    }


def test_images_are_refused_for_a_model_that_cannot_see_them(default_spec: ModelSpec):
    from api.protocols import chat_completions

    body = _image_body("default")
    error = _error(prepare, chat_completions.PROTOCOL, body, _context(default_spec))
    assert (error.status, error.param) == (400, "messages")
    assert "does not accept images" in error.message


def test_a_placeholder_model_reads_unsupported_image_as_plain_text(default_spec: ModelSpec):
    from api.protocols import chat_completions

    blind = ModelSpec("blind", default_spec.weights, prompt_format="chatml", images="placeholder")
    encoded = encode_request(chat_completions.PROTOCOL.parse(_image_body("blind")), _context(blind))
    prompt = encoded.rendered.prompt
    start = prompt.index("What is it?[Unsupported Image]")
    assert not any(s <= start < e for s, e in encoded.rendered.special_ranges)
    assert encoded.images == [] and encoded.rendered.image_sources == []


@pytest.fixture(scope="module")
def vision_context(tmp_path_factory: pytest.TempPathFactory) -> PreparationContext:
    """A random-weight Idefics3 checkpoint with a short context, as the API serves it."""
    weights = make_idefics3(tmp_path_factory.mktemp("vlm"))
    spec = ModelSpec("seer", weights, capabilities=frozenset({"images"}))
    processing = load_image_processing(weights)
    served = ServedModel(spec, load_tokenizer(weights), 600, processing)
    return PreparationContext(ModelRegistry([spec]), {spec.name: served})


def test_an_image_becomes_its_layout_of_image_tokens(vision_context: PreparationContext):
    from api.protocols import chat_completions

    body = _image_body("seer")
    body["messages"][0]["content"][0]["text"] = "What is <image> here?"  # typed, not a token
    prepared = prepare(chat_completions.PROTOCOL, body, vision_context)
    served = vision_context.models["seer"]
    processing = served.image_processing
    assert processing is not None
    image_id = served.tokenizer.special_tokens["<image>"]
    ids = prepared.wire.prompt_token_ids
    (image,) = prepared.wire.images
    rows, cols = processing.grid(32, 24)
    tiles = rows * cols + 1
    assert ids.count(image_id) == tiles * processing.image_seq_len  # the typed one is text
    inside = ids[image.start : image.end]
    assert inside.count(image_id) == ids.count(image_id)
    assert base64.b64decode(image.data) == png_bytes()
    assert "What is <image> here?" in served.tokenizer.tokenizer.decode(ids)

    body["max_tokens"] = 600 - len(ids) + 1  # the image's tokens count against the context
    error = _error(prepare, chat_completions.PROTOCOL, body, vision_context)
    assert error.status == 400 and f"{len(ids)} in the messages" in error.message


# --- constraints -----------------------------------------------------------------


def _accepts(ctx: PreparationContext, grammar: str, text: str) -> bool:
    """Whether the grammar matches ``text`` completely, on the model's tokenizer."""
    tokenizer = lltokenizer(next(iter(ctx.models.values())).tokenizer)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


def test_no_constraint_leaves_the_output_free(ctx: PreparationContext):
    assert prepare(MINIMAL, {"model": "default"}, ctx).wire.sampling.structured_outputs is None


def test_a_thinking_model_is_constrained_after_its_reasoning():
    ctx = _context(_qwen3_like())
    body = {"model": "thinker", "structured_outputs": StructuredOutputs(choice=["yes", "no"])}
    spec = prepare(MINIMAL, body, ctx).wire.sampling.structured_outputs
    assert spec is not None and spec.grammar is not None
    assert _accepts(ctx, spec.grammar, "<think>\nMaybe {yes}.\n</think>\n\nyes")
    assert not _accepts(ctx, spec.grammar, "<think>\nhmm\n</think>\n\nperhaps")
    body["thinking"] = False
    spec = prepare(MINIMAL, body, ctx).wire.sampling.structured_outputs
    assert spec is not None and _accepts(ctx, spec.grammar or "", "yes")


def test_a_forced_call_is_a_grammar_in_the_models_syntax(ctx: PreparationContext):
    body = {"model": "default", "tools": ["f", "g"], "tool_choice": "required"}
    spec = prepare(MINIMAL, body, ctx).wire.sampling.structured_outputs
    assert spec is not None and spec.grammar is not None
    call = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    assert _accepts(ctx, spec.grammar, call)
    assert _accepts(ctx, spec.grammar, call + "\n" + call.replace('"g"', '"f"'))
    assert not _accepts(ctx, spec.grammar, "Sure! " + call)
    body["parallel"] = False
    spec = prepare(MINIMAL, body, ctx).wire.sampling.structured_outputs
    assert spec is not None and not _accepts(ctx, spec.grammar or "", call + "\n" + call)


def test_a_named_function_is_called_once(ctx: PreparationContext):
    body = {"model": "default", "tools": ["f", "g"], "tool_choice": "function"}
    body["tool_name"] = "g"
    spec = prepare(MINIMAL, body, ctx).wire.sampling.structured_outputs
    call = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    assert spec is not None and _accepts(ctx, spec.grammar or "", call)
    assert not _accepts(ctx, spec.grammar or "", call + "\n" + call)
    assert not _accepts(ctx, spec.grammar or "", call.replace('"g"', '"f"'))


def test_llama3_json_models_are_forced_into_their_own_syntax():
    base = default_registry().resolve("default")
    llama = ModelSpec("llama", base.weights, prompt_format="chatml", tool_parser="llama3_json")
    ctx = _context(llama)
    body = {"model": "llama", "tools": ["f"], "tool_choice": "required"}
    prepared = prepare(MINIMAL, body, ctx)
    grammar = prepared.wire.sampling.structured_outputs.grammar  # type: ignore[union-attr]
    assert _accepts(ctx, grammar, '{"name": "f", "parameters": {}}')
    assert prepared.wire.parsing.bare_json_tool_calls and prepared.wire.parsing.tool_calls is None


def test_a_strict_tool_whose_schema_cannot_be_enforced_is_a_400(ctx: PreparationContext):
    unenforceable = {"type": "object", "properties": {"a": {"if": {}}}}
    strict = Tool("f", parameters=unenforceable, strict=True)
    body = {"model": "default", "tools": [strict], "tool_choice": "required"}
    error = _error(prepare, MINIMAL, body, ctx)
    assert (error.status, error.param) == (400, "tools[0].parameters")
    body["tools"] = [Tool("f", parameters=unenforceable)]  # not strict: any JSON object
    spec = prepare(MINIMAL, body, ctx).wire.sampling.structured_outputs
    call = '<tool_call>\n{"name": "f", "arguments": {"b": [1]}}\n</tool_call>'
    assert spec is not None and _accepts(ctx, spec.grammar or "", call)


def test_two_constraints_at_once_are_a_400(ctx: PreparationContext):
    body = {
        "model": "default",
        "structured_outputs": StructuredOutputs(regex="a+"),
        "response_format": ResponseFormat("json_object"),
    }
    error = _error(prepare, MINIMAL, body, ctx)
    assert (error.status, error.param) == (400, "structured_outputs")


def test_an_invalid_response_format_schema_names_where_it_was_written(ctx: PreparationContext):
    schema = {"type": "string", "format": "no-such-format"}
    response_format = ResponseFormat("json_schema", schema, param="text.format.schema")
    error = _error(prepare, MINIMAL, {"model": "default", "response_format": response_format}, ctx)
    assert (error.status, error.param) == (400, "text.format.schema")
    assert "no-such-format" in error.message


def test_tool_choice_none_ends_the_answer_at_a_calls_markup(ctx: PreparationContext):
    body = {"model": "default", "tools": ["f"], "tool_choice": "none", "stop": ["END"]}
    prepared = prepare(MINIMAL, body, ctx)
    assert prepared.wire.sampling.stop == ["END", HERMES_TOOL_CALL.open]
    assert prepared.wire.parsing.tool_calls is None


def test_a_prompt_too_long_by_its_length_alone_is_refused_before_encoding(ctx: PreparationContext):
    huge = "word " * 2_000_000  # ten million characters: far past 512 tokens of any length
    error = _error(prepare, MINIMAL, {"model": "default", "messages": [huge]}, ctx)
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    assert "at least" in error.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": ["hi"] * 4097}, "messages"),
        ({"tools": [f"f{i}" for i in range(513)], "tool_choice": "auto"}, "tools"),
    ],
)
def test_a_request_past_a_count_limit_is_a_400_naming_it(
    ctx: PreparationContext, body: dict, param: str
):
    error = _error(prepare, MINIMAL, {"model": "default", **body}, ctx)
    assert (error.status, error.param, error.code) == (400, param, "limit_exceeded")
    assert "at most" in error.message
