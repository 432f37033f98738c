"""From a request body to a ``PreparedRequest``: the CPU work before generation.

``prepare`` reads in the order the work happens: parse, resolve the model,
render, encode, resolve images, resolve max_tokens, build sampling and
parsing options. Each step raises an ``ApiError`` whose status says whose
fault it is: 400/404 for what the client sent, 500 for a model we configured
badly, 503 for a server too busy right now. It is plain blocking code; the
route runs it in a bounded threadpool.

Images are paid for before they cost anything: their headers give their
sizes, the sizes give their tokens, and the tokens are reserved from the
server's image budget before a pixel is decoded. The reservation stays with
the prepared request until it ends, and is given back if preparation fails.
"""

from __future__ import annotations

import functools
import hashlib
import re
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from tokenizers import Tokenizer

from api.backends.base import ServedModel
from api.errors import ApiError, bad_request
from api.images.budget import ImageTokenBudget, ImageTokens, released_on_error
from api.images.resolution import (
    ImageOptions,
    OpenedImage,
    check_image_count,
    decode_images,
    open_images,
)
from api.output_parser import HERMES_TOOL_CALL, THINK, Delimiters, ParserConfig
from api.protocols.base import GenerationRequest, Protocol, RawPrompt, ResponseContext
from shared import dsml
from shared.constraints import (
    ANY_OBJECT,
    ConstraintError,
    ToolCallSyntax,
    ToolSpec,
    after_reasoning,
    check,
    dsml_tool_call_grammar,
    grammar_of,
    lltokenizer,
    schema_is_enforceable,
    tool_call_grammar,
)
from shared.conversation import (
    Conversation,
    ConversationError,
    ImagePart,
    ImageSource,
    has_images,
    images_as_text,
)
from shared.events import InferenceEvent
from shared.generation_config import NO_DEFAULTS, SamplingDefaults
from shared.images.layout import ImageProcessing, expand_images, image_tokens_reserved
from shared.prompting import PromptFormatError, RenderedPrompt, render
from shared.registry import UNSUPPORTED_IMAGE, ModelRegistry, ModelSpec
from shared.sampling import SamplingParams, StructuredOutputs
from shared.tokenization import PromptEncodingError, encode_prompt, encode_text
from shared.wire import ParsingOptions, PreparedRequest, WireImage

DEFAULT_MAX_TOKENS = 8192
# What one request may hold, beyond which it is refused before any rendering.
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 512
MAX_TOOLS = 512
THINKING_MAX_TOKENS = 65536
MAX_EFFORT_MAX_TOKENS = 131072

T = TypeVar("T")
_HERMES_FORMATS = frozenset({"chatml", "qwen3"})
ModelToolSyntax = ToolCallSyntax | Literal["dsml"]
_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*) ")


@dataclass(slots=True)
class PreparationContext:
    """What preparation looks up: accepted names, the loaded models, how images resolve, the
    image tokens a generation reserves (None: none are reserved), and what an object schema
    that leaves out ``additionalProperties`` allows (``shared.constraints``)."""

    registry: ModelRegistry
    models: Mapping[str, ServedModel]  # by registry name (``spec.name``)
    images: ImageOptions = field(default_factory=ImageOptions)
    image_tokens: ImageTokenBudget | None = None
    additional_properties: bool = False


@dataclass(slots=True)
class Encoded:
    """A request rendered and encoded for one model, each image in its span of the ids."""

    request: GenerationRequest
    model: ServedModel
    rendered: RenderedPrompt
    token_ids: list[int]
    images: list[WireImage] = field(default_factory=list)
    image_tokens: ImageTokens | None = None  # the images' reserved tokens, if reserved


@dataclass(slots=True)
class Prepared:
    """Everything the route needs: the wire request plus how to build the response."""

    protocol: Protocol
    request: GenerationRequest
    context: ResponseContext
    wire: PreparedRequest
    model: ServedModel
    image_tokens: ImageTokens | None = None  # held until the request ends

    @property
    def parser_config(self) -> ParserConfig:
        return parser_config(self.wire.parsing)

    def release(self) -> None:
        """Give back what preparation reserved, for a request that will not run.

        One dropped unreleased gives it back when it is collected.
        """
        if self.image_tokens is not None:
            self.image_tokens.release()

    def holding(self, events: AsyncIterator[InferenceEvent]) -> AsyncIterator[InferenceEvent]:
        """``events``, with what preparation reserved held until they end."""
        return events if self.image_tokens is None else self.image_tokens.held_during(events)


def new_request_id(protocol: Protocol) -> str:
    """A fresh id in the protocol's own style (``chatcmpl-…``, ``msg_…``, ``resp_…``)."""
    return protocol.id_prefix + secrets.token_hex(12)


def prepare(
    protocol: Protocol,
    body: dict[str, Any],
    ctx: PreparationContext,
    request_id: str | None = None,
) -> Prepared:
    """Parse, render, encode and resolve one request; raises ``ApiError``.

    ``request_id`` is the id the route already chose (its job's id, say), if any. The
    images' tokens are reserved from ``ctx.image_tokens`` before they are decoded, and the
    reservation travels in the result (``Prepared.image_tokens``) or is given back.
    """
    request = protocol.parse(body)  # 400 naming the field
    # 404 unknown model, 400 bad conversation, 503 while the image token budget is in use
    encoded = encode_request(request, ctx, reserve_from=ctx.image_tokens)
    with released_on_error(encoded.image_tokens):
        return _prepared(protocol, request, encoded, request_id, ctx.additional_properties)


def _prepared(
    protocol: Protocol,
    request: GenerationRequest,
    encoded: Encoded,
    request_id: str | None,
    additional_properties: bool,
) -> Prepared:
    """The rest, once the request is encoded: max_tokens, sampling, constraint, the wire."""
    model, prompt_ids = encoded.model, encoded.token_ids
    _require_reasoning_support(request, model.spec)
    thinking = thinking_mode(request.conversation, model.spec)
    max_tokens = resolve_max_tokens(
        request.max_tokens,
        len(prompt_ids),
        model.context_length,
        thinking=thinking,
        max_effort=request.conversation.reasoning_effort == "max",
        param=request.max_tokens_param,
        default=model.sampling_defaults.max_tokens,
    )  # 400: the context cannot hold what was asked for
    sampling = sampling_params(request, max_tokens, model.sampling_defaults)  # 400 naming the field
    _check_token_ids(sampling, model)  # 400: ids outside the vocabulary
    # 400: a grammar llguidance refuses
    sampling.structured_outputs = constraint(encoded, thinking, additional_properties)
    sampling.stop += hidden_stops(encoded)
    context = ResponseContext(
        request_id=request_id or new_request_id(protocol),
        model=request.model,
        created=int(time.time()),
        system_fingerprint=fingerprint(model.spec),
    )
    wire = PreparedRequest(
        request_id=context.request_id,
        model=model.spec.name,
        prompt_token_ids=prompt_ids,
        images=encoded.images,
        sampling=sampling,
        parsing=parsing_options(encoded, thinking),
        priority=request.priority or 0,
        created=time.time(),
    )
    return Prepared(protocol, request, context, wire, model, encoded.image_tokens)


def check_request_limits(conversation: Conversation, images: ImageOptions) -> None:
    """A 400 naming the limit for a request with more of something than it may hold."""
    parts = [getattr(message, "content", []) for message in conversation.messages]
    check_image_count(
        sum(isinstance(p, ImagePart) for content in parts for p in content), images.quota
    )
    for what, count, most in (
        ("messages", len(conversation.messages), MAX_MESSAGES),
        ("tools", len(conversation.tools), MAX_TOOLS),
    ):
        if count > most:
            raise bad_request(
                f"a request may hold at most {most} {what}, this one has {count}",
                what.split()[-1],
                "limit_exceeded",
            )
    for index, content in enumerate(parts):
        if len(content) > MAX_CONTENT_PARTS:
            raise bad_request(
                f"a message may hold at most {MAX_CONTENT_PARTS} content parts, "
                f"message {index} has {len(content)}",
                "messages",
                "limit_exceeded",
            )


def encode_request(
    request: GenerationRequest,
    ctx: PreparationContext,
    reserve_from: ImageTokenBudget | None = None,
) -> Encoded:
    """Resolve the model, render the conversation in its format and encode it safely.

    A generation reserves its images' tokens from ``reserve_from`` before they
    are decoded (``Encoded.image_tokens``); counting tokens reserves none.
    """
    check_request_limits(request.conversation, ctx.images)  # 400 naming the limit
    model = resolve_model(request.model, ctx)
    if request.prompt is not None:
        return encode_raw(request, request.prompt, model)
    conversation = _seen_images(request.conversation, model)  # 400: a model that cannot see
    rendered = render_conversation(conversation, model)
    _refuse_if_surely_too_long(rendered, model)
    ids = _encode(rendered, model)
    encoded = Encoded(request, model, rendered, ids)
    return _with_images(encoded, ctx, reserve_from) if rendered.image_sources else encoded


def _with_images(
    encoded: Encoded, ctx: PreparationContext, reserve_from: ImageTokenBudget | None
) -> Encoded:
    """``encoded`` with its images resolved and each placeholder expanded into its layout.

    The tokens the images take are reserved from their headers before any is
    decoded, and settled to their exact count after.
    """
    model, processing = encoded.model, encoded.model.image_processing
    assert processing is not None  # _seen_images kept them: a vision model
    sources = encoded.rendered.image_sources
    _check_details(sources, model, processing)
    opened = open_images(sources, ctx.images)  # 400 the image, 5xx fetch
    reserved = _reserve(opened, model, reserve_from)  # 400 never fits, 503 in use
    with released_on_error(reserved):
        resolved = decode_images(opened, ctx.images, processing)  # 400 undecodable, 503 full
        try:
            encoded.token_ids, encoded.images = expand_images(
                encoded.token_ids, resolved, processing, model.tokenizer
            )
        except ValueError as exc:  # the model's template or tokenizer, not the client
            raise ApiError(500, f"model {model.spec.served_name!r}: {exc}", "api_error") from None
        if reserved is not None:  # decoded: each image's layout, so its span, is known
            reserved.settle(sum(image.end - image.start for image in encoded.images))
    encoded.image_tokens = reserved
    return encoded


def _check_details(
    sources: list[ImageSource], model: ServedModel, processing: ImageProcessing
) -> None:
    """A 400 for an image asking for a ``detail`` the model's image processing does not serve."""
    for index, source in enumerate(sources):
        if source.detail not in processing.details:
            served = ", ".join(repr(detail) for detail in processing.details)
            raise bad_request(
                f"image {index}: detail {source.detail!r} is not supported by model "
                f"{model.spec.served_name!r}, which serves {served}",
                "detail",
            )


def _reserve(
    opened: list[OpenedImage], model: ServedModel, budget: ImageTokenBudget | None
) -> ImageTokens | None:
    """The tokens the images are expected to take in the prompt, as their headers say,
    reserved from ``budget``; None without a budget."""
    if budget is None:
        return None
    processing, tokenizer = model.image_processing, model.tokenizer
    assert processing is not None
    return budget.reserve(
        sum(image_tokens_reserved(image.size, processing, tokenizer) for image in opened)
    )


def encode_raw(request: GenerationRequest, prompt: RawPrompt, model: ServedModel) -> Encoded:
    """A prompt with no template: its token ids as given, or its text encoded as plain text.

    Control-token spellings in the text stay text unless the model's registry
    entry opts out (``raw_prompt_control_tokens``).
    """
    tokenizer = model.tokenizer.tokenizer
    if prompt.token_ids is not None:
        _check_ids("prompt", prompt.token_ids, model)
        prompt.text = tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
        return Encoded(request, model, RenderedPrompt(prompt.text), list(prompt.token_ids))
    rendered = RenderedPrompt(prompt.text or "")
    _refuse_if_surely_too_long(rendered, model)
    control_tokens = model.spec.raw_prompt_control_tokens
    ids = encode_text(rendered.prompt, model.tokenizer, control_tokens=control_tokens)
    if not ids:
        raise bad_request("prompt must not be empty", "prompt")
    return Encoded(request, model, rendered, ids)


def _encode(rendered: RenderedPrompt, model: ServedModel) -> list[int]:
    try:
        return encode_prompt(rendered, model.tokenizer)
    except PromptEncodingError as exc:  # the renderer or the tokenizer is at fault, not the client
        raise ApiError(500, str(exc), "api_error") from exc


def _refuse_if_surely_too_long(rendered: RenderedPrompt, model: ServedModel) -> None:
    """A 400 before tokenizing, for a prompt whose length alone rules out the context.

    No token is longer than the vocabulary's longest entry, so the prompt has
    at least ``len(prompt) / longest`` tokens: a body of megabytes is refused
    in microseconds instead of being tokenized whole.
    """
    at_least = len(rendered.prompt) // _longest_token(model.tokenizer.tokenizer)
    if at_least >= model.context_length:
        raise bad_request(
            f"This model's maximum context length is {model.context_length} tokens. However, "
            f"your messages resulted in at least {at_least} tokens. Please reduce the length "
            "of the messages.",
            "messages",
            "context_length_exceeded",
        )


@functools.cache
def _longest_token(tokenizer: Tokenizer) -> int:
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def _seen_images(conversation: Conversation, model: ServedModel) -> Conversation:
    """The conversation as the model takes it: a model that cannot see gets placeholder text
    (``images = "placeholder"``) or refuses the request with a 400 rather than drop an image.
    """
    spec = model.spec
    if model.image_processing is not None:
        return conversation
    if spec.images == "placeholder":
        return images_as_text(conversation, UNSUPPORTED_IMAGE)
    for index, message in enumerate(conversation.messages):
        if has_images(getattr(message, "content", [])):
            raise bad_request(
                f"model {spec.served_name!r} does not accept images (it is not a vision model); "
                f"message {index} contains one",
                "messages",
            )
    return conversation


def resolve_model(name: str, ctx: PreparationContext) -> ServedModel:
    """The loaded model for a name or alias.

    An unknown name is the client's mistake in the request body: 400, with
    every accepted name listed. Only registered names are looked up: a name
    is never read as a path over HTTP, so the answer is the same whether or not
    a file of that name exists on the server.
    """
    if name not in ctx.registry.names():
        accepted = ", ".join(ctx.registry.names())
        raise bad_request(
            f"The supported API model names are {accepted}, but you passed {name}.",
            "model",
            "model_not_found",
        )
    spec = ctx.registry.resolve(name)
    model = ctx.models.get(spec.name)
    if model is None:  # registered, but this server did not load it
        raise ApiError(
            503, f"model {spec.served_name!r} is not loaded on this server", "overloaded_error"
        )
    return model


def render_conversation(conversation: Conversation, model: ServedModel) -> RenderedPrompt:
    """Lay out the conversation with the model's prompt format and control tokens."""
    tok, spec = model.tokenizer, model.spec
    decode = tok.tokenizer.id_to_token
    try:
        return render(
            conversation,
            spec.prompt_format,
            special_tokens=tok.special_tokens,
            chat_template=model.chat_template,
            default_system_prompt=spec.default_system_prompt,
            bos_token=decode(tok.bos_token_id) if tok.bos_token_id is not None else None,
            eos_token=decode(tok.eos_token_id) if tok.eos_token_id is not None else None,
            content_format=spec.chat_template_content_format,
        )
    except ConversationError as exc:  # the client sent what the format cannot express
        raise bad_request(str(exc), _leading_field(str(exc))) from exc
    except PromptFormatError as exc:  # the model is configured with an unusable format
        raise ApiError(500, str(exc), "api_error") from exc


def can_think(spec: ModelSpec) -> bool:
    return spec.prompt_format == "qwen3" or "thinking" in spec.capabilities


def _require_reasoning_support(request: GenerationRequest, spec: ModelSpec) -> None:
    """Asking a model that cannot reason to reason, or how hard, is a 400, not ignored."""
    conversation = request.conversation
    asked = conversation.thinking is True or conversation.reasoning_effort is not None
    if asked and not can_think(spec):
        raise bad_request(
            f"{request.thinking_param}: model {spec.served_name!r} does not support reasoning",
            request.thinking_param,
            "unsupported_parameter",
        )


def thinking_mode(conversation: Conversation, spec: ModelSpec) -> bool:
    """Whether the model will reason first.

    Only models that can think do; for them "unset" means yes (Qwen3's
    default), and an explicit ``thinking: false`` turns it off.
    """
    return can_think(spec) and conversation.thinking is not False


def resolve_max_tokens(
    requested: int | None,
    prompt_tokens: int,
    context_length: int,
    *,
    thinking: bool = False,
    max_effort: bool = False,
    param: str = "max_tokens",
    default: int | None = None,
) -> int:
    """The completion budget: the request's, or a default that fits the context.

    A requested value is kept only if prompt and completion fit (OpenAI's
    message, word for word, so clients that parse it keep working). Unset, it
    is ``default`` (the checkpoint's ``max_new_tokens``) or a generous one
    (more when thinking: reasoning is long), clamped to what the context leaves.
    """
    if requested is not None and prompt_tokens + requested > context_length:
        raise bad_request(
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the messages, "
            f"{requested} in the completion). Please reduce the length of the messages or "
            "completion.",
            param,
            "context_length_exceeded",
        )
    if prompt_tokens >= context_length:
        raise bad_request(
            f"This model's maximum context length is {context_length} tokens. However, your "
            f"messages resulted in {prompt_tokens} tokens. Please reduce the length of the "
            "messages.",
            "messages",
            "context_length_exceeded",
        )
    if requested is not None:
        return requested
    if default is None and thinking:
        default = MAX_EFFORT_MAX_TOKENS if max_effort else THINKING_MAX_TOKENS
    elif default is None:
        default = DEFAULT_MAX_TOKENS
    return max(1, min(default, context_length - prompt_tokens))


def sampling_params(
    request: GenerationRequest, max_tokens: int, defaults: SamplingDefaults = NO_DEFAULTS
) -> SamplingParams:
    """The request's sampling fields; what it left unset comes from the checkpoint's
    ``defaults``, else from OpenAI's."""

    def chosen(value: T | None, default: T | None, fallback: T) -> T:
        return next(v for v in (value, default, fallback) if v is not None)

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=chosen(request.temperature, defaults.temperature, 1.0),
            top_p=chosen(request.top_p, defaults.top_p, 1.0),
            top_k=chosen(request.top_k, defaults.top_k, 0),
            min_p=chosen(request.min_p, defaults.min_p, 0.0),
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=chosen(request.repetition_penalty, defaults.repetition_penalty, 1.0),
            seed=request.seed,
            stop=list(request.stop),
            stop_token_ids=list(request.stop_token_ids),
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            logit_bias=dict(request.logit_bias),
            skip_special_tokens=request.skip_special_tokens,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
        )
    except ValueError as exc:  # SamplingParams names the field first
        raise bad_request(str(exc), _leading_field(str(exc))) from exc


def constraint(
    encoded: Encoded, thinking: bool, additional_properties: bool = False
) -> StructuredOutputs | None:
    """The request's constraint as one checked grammar, or None when the output is free.

    A forced tool call, ``structured_outputs`` and a JSON response format are
    each a grammar; a thinking model's grammar starts after its reasoning.
    ``additional_properties`` is what an object schema that leaves it out allows.
    """
    request, model = encoded.request, encoded.model
    conversation = request.conversation
    sources = [
        name
        for name, given in (
            ("tool_choice", conversation.tool_choice.mode in ("required", "function")),
            ("structured_outputs", request.structured_outputs is not None),
            (conversation.response_format.param, conversation.response_format.type != "text"),
        )
        if given
    ]
    if not sources:
        return None
    if len(sources) > 1 and "structured_outputs" in sources:
        others = ", ".join(name for name in sources if name != "structured_outputs")
        raise bad_request(
            f"structured_outputs cannot be combined with {others}: send one constraint",
            "structured_outputs",
        )
    field = sources[0]
    try:
        grammar = _grammar(encoded, field, additional_properties)
        if thinking:
            token = model.tokenizer.special_tokens.get(THINK.close)
            grammar = after_reasoning(grammar, THINK.close, token)
        check(grammar, field, lltokenizer(model.tokenizer))
    except ConstraintError as exc:  # named where the client wrote it, or the tool's schema
        param = exc.field if exc.field.startswith("tools[") else field
        raise bad_request(f"{param}: {exc.reason}", param) from None
    return StructuredOutputs(grammar=grammar)


def _grammar(encoded: Encoded, field: str, additional_properties: bool) -> str:
    request = encoded.request
    conversation = request.conversation
    if field == "tool_choice":
        return _tool_call_grammar(encoded, additional_properties)
    if field == "structured_outputs":
        assert request.structured_outputs is not None
        spec = request.structured_outputs
    elif conversation.response_format.type == "json_object":
        spec = StructuredOutputs(json_object=True)
    else:
        spec = StructuredOutputs(json=conversation.response_format.schema)
    return grammar_of(spec, additional_properties=additional_properties)


def _tool_call_grammar(encoded: Encoded, additional_properties: bool) -> str:
    """One call to the named tool, or calls to any tool, in the model's syntax.

    A ``strict`` tool's arguments match its schema, and a schema the grammar
    engine cannot enforce is refused; a non-strict tool's arguments match it
    where it can, and are at least a JSON object.
    """
    conversation = encoded.request.conversation
    choice = conversation.tool_choice
    syntax = tool_call_syntax(encoded.model)
    if syntax is None:
        raise bad_request(
            f"tool_choice {choice.mode!r}: model {encoded.model.spec.served_name!r} has no "
            "tool-call syntax to enforce",
            "tool_choice",
        )
    specs = []
    for index, tool in enumerate(conversation.tools):
        if choice.mode == "function" and tool.name != choice.name:
            continue
        parameters = tool.parameters
        if not schema_is_enforceable(parameters):
            if tool.strict:
                check(grammar_of(StructuredOutputs(json=parameters)), f"tools[{index}].parameters")
            parameters = ANY_OBJECT
        specs.append(ToolSpec(tool.name, parameters))
    # A named function is one call (as vLLM forces it); "required" allows several when parallel.
    parallel = choice.parallel and choice.mode == "required"
    if syntax == "dsml":
        return dsml_tool_call_grammar(
            specs,
            dsml.MARKUPS[encoded.model.spec.prompt_format],
            parallel=parallel,
            opened=_opens_tool_calls(encoded),
            additional_properties=additional_properties,
        )
    return tool_call_grammar(
        specs, syntax, parallel=parallel, additional_properties=additional_properties
    )


def tool_call_syntax(model: ServedModel) -> ModelToolSyntax | None:
    """How the model writes tool calls, or None when it has no syntax we read."""
    if model.spec.prompt_format in dsml.MARKUPS:
        return "dsml"
    if model.spec.tool_parser == "llama3_json":
        return "llama3_json"
    return "hermes" if _hermes_tool_calls(model) else None


def tool_call_block(model: ServedModel) -> Delimiters:
    """The markup around the model's tool calls (``<tool_call>`` for Hermes)."""
    if model.spec.prompt_format in dsml.MARKUPS:
        return Delimiters(*dsml.MARKUPS[model.spec.prompt_format].block_delimiters)
    return HERMES_TOOL_CALL


def _opens_tool_calls(encoded: Encoded) -> bool:
    """Whether the prompt ends inside a tool-call block it opened (a forced DSML call)."""
    syntax = tool_call_syntax(encoded.model)
    opening = tool_call_block(encoded.model).open + "\n"
    return syntax == "dsml" and encoded.rendered.prompt.endswith(opening)


def hidden_stops(encoded: Encoded) -> list[str]:
    """With tools offered but ``tool_choice: none``, a call's opening markup ends the answer.

    The client is never shown the markup of a call it ruled out.
    """
    conversation = encoded.request.conversation
    ruled_out = conversation.tools and conversation.tool_choice.mode == "none"
    delimited = tool_call_syntax(encoded.model) in ("hermes", "dsml")
    return [tool_call_block(encoded.model).open] if ruled_out and delimited else []


def _check_token_ids(sampling: SamplingParams, model: ServedModel) -> None:
    _check_ids("stop_token_ids", sampling.stop_token_ids, model)
    _check_ids("logit_bias", list(sampling.logit_bias), model)


def _check_ids(field: str, ids: list[int], model: ServedModel) -> None:
    vocab = model.tokenizer.tokenizer.get_vocab_size()
    bad = next((token for token in ids if not 0 <= token < vocab), None)
    if bad is not None:
        raise bad_request(f"{field}: token id {bad} is outside the vocabulary [0, {vocab})", field)


def parsing_options(encoded: Encoded, thinking: bool) -> ParsingOptions:
    """Which markup the output parser should look for in this request's output."""
    conversation = encoded.request.conversation
    reasoning = THINK if thinking else None
    tools = bool(conversation.tools) and conversation.tool_choice.mode != "none"
    syntax = tool_call_syntax(encoded.model) if tools else None
    delimited = syntax in ("hermes", "dsml")
    return ParsingOptions(
        reasoning=_pair(reasoning),
        starts_in_reasoning=reasoning is not None and _opens(encoded.rendered, reasoning),
        tool_calls=_pair(tool_call_block(encoded.model)) if delimited else None,
        bare_json_tool_calls=syntax == "llama3_json",
        dsml_tool_calls=syntax == "dsml",
        starts_in_tool_calls=tools and _opens_tool_calls(encoded),
        single_tool_call=tools and not conversation.tool_choice.parallel,
    )


def parser_config(options: ParsingOptions) -> ParserConfig:
    """The output parser's configuration for wire-level parsing options."""
    return ParserConfig(
        reasoning=Delimiters(*options.reasoning) if options.reasoning else None,
        starts_in_reasoning=options.starts_in_reasoning,
        tool_calls=Delimiters(*options.tool_calls) if options.tool_calls else None,
        bare_json_tool_calls=options.bare_json_tool_calls,
        dsml_tool_calls=options.dsml_tool_calls,
        starts_in_tool_calls=options.starts_in_tool_calls,
        single_tool_call=options.single_tool_call,
    )


def fingerprint(spec: ModelSpec) -> str:
    """A stable ``system_fingerprint`` per served model and format."""
    digest = hashlib.blake2s(f"sluice:{spec.name}:{spec.prompt_format}".encode()).hexdigest()
    return "fp_" + digest[:10]


def _hermes_tool_calls(model: ServedModel) -> bool:
    """True when the model calls tools with ``<tool_call>`` JSON blocks."""
    if model.spec.prompt_format in _HERMES_FORMATS:
        return True
    template = model.chat_template or ""
    return model.spec.prompt_format == "jinja" and HERMES_TOOL_CALL.open in template


def _opens(rendered: RenderedPrompt, delimiters: Delimiters) -> bool:
    """Whether the prompt ends inside an opened block (the template opened reasoning).

    Only the text after the last turn's control token is looked at, so a
    delimiter typed in an earlier message cannot flip it.
    """
    markers = {delimiters.open, delimiters.close}
    turn_start = 0
    for start, end in rendered.special_ranges:
        if rendered.prompt[start:end] not in markers:
            turn_start = end
    tail = rendered.prompt[turn_start:]
    return tail.rfind(delimiters.open) > tail.rfind(delimiters.close)


def _pair(delimiters: Delimiters | None) -> tuple[str, str] | None:
    return (delimiters.open, delimiters.close) if delimiters else None


def _leading_field(message: str) -> str | None:
    """The field a validation message starts with (``"temperature must be …"``)."""
    match = _FIELD.match(message)
    return match.group(1) if match else None
