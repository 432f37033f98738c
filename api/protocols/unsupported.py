"""Fields a protocol (or vLLM) defines that Sluice does not serve: each is a 400 that says so.

A field we accept is a field we honour, so every field below is refused
unless its value asks for what the server does anyway (``store: false``,
``modalities: ["text"]``, ``include_reasoning: true``, ...). A dotted name
is a field inside an object field. One table per protocol; ``refuse`` reads
a raw request body against it before the protocol parses the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from api.errors import bad_request

Harmless = Callable[[Any], bool] | None  # which values are served anyway; None: none is


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is type(v) for v in values)


_OFF = _is(False)
_DEFAULT_TIER = _is("auto", "default")

# vLLM's sampling and serving extensions that Chat Completions and Completions share.
_VLLM: dict[str, Harmless] = {
    "allowed_token_ids": None,
    "bad_words": _is([]),
    "cache_salt": None,
    "ec_transfer_params": None,
    "guided_choice": None,  # vLLM's older spellings: structured_outputs holds them now
    "guided_grammar": None,
    "guided_json": None,
    "guided_regex": None,
    "include_stop_str_in_output": _OFF,
    "kv_transfer_params": None,
    "length_penalty": _is(1, 1.0),
    "logprob_token_ids": None,
    "prompt_logprobs": None,
    "repetition_detection": None,
    "request_id": None,
    "return_token_ids": _OFF,
    "return_tokens_as_token_ids": _OFF,
    "routed_experts_prompt_start": None,
    "spaces_between_special_tokens": _is(True),
    "stream_interval": _is(1),
    "truncation_side": None,  # named first: it only means something with the next
    "truncate_prompt_tokens": None,
    "use_beam_search": _OFF,
    "vllm_xargs": None,
    "watermarking": _OFF,
}

CHAT_COMPLETIONS: dict[str, Harmless] = {
    "audio": None,
    "function_call": None,  # the deprecated spelling of tool_choice, for functions (refused)
    "modalities": _is(["text"]),
    "moderation": None,
    "prediction": None,
    "prompt_cache_options": None,
    "prompt_cache_retention": None,
    "service_tier": _DEFAULT_TIER,
    "store": _OFF,
    "stream_options.include_obfuscation": _OFF,
    "verbosity": None,
    "web_search_options": None,
    # vLLM's extensions
    **_VLLM,
    "add_generation_prompt": _is(True),
    "add_special_tokens": _OFF,
    "chat_template": None,
    "documents": None,
    "echo": _OFF,
    "include_reasoning": _is(True),
    "media_io_kwargs": None,
    "mm_processor_kwargs": None,
    "return_mm_kwargs": _OFF,
    "return_prompt_text": _OFF,
    "return_token_offsets": _OFF,
    "session_id": None,
    "thinking_token_budget": None,
}

COMPLETIONS: dict[str, Harmless] = {
    "stream_options.include_obfuscation": _OFF,
    # vLLM's extensions
    **_VLLM,
    "add_special_tokens": _is(True),  # BOS where the tokenizer wants it, as vLLM's default
    "logits_processors": None,
    "prompt_embeds": None,
    "response_format": _is({"type": "text"}),
}

RESPONSES: dict[str, Harmless] = {
    "access_programs": None,
    "background_options": None,
    "context_management": None,
    "image": None,
    "max_tool_calls": None,
    "moderation": None,
    "prompt": None,
    "prompt_cache_options": None,
    "prompt_cache_retention": None,
    "reasoning.summary": _is("auto"),  # "auto" lets the server choose: no summary
    "service_tier": _DEFAULT_TIER,
    "stream_options.include_obfuscation": _OFF,
    "text.verbosity": None,
    "truncation": _is("disabled"),
}

MESSAGES: dict[str, Harmless] = {
    "container": None,
    "diagnostics": None,
    "inference_geo": None,
    "service_tier": _is("auto", "standard_only"),
    "speed": _is("standard"),
}


def refuse(body: Any, table: Mapping[str, Harmless]) -> set[str]:
    """A 400 for the first field of ``table`` set in ``body`` to a value not served anyway.

    Returns the top-level names the table covers: read, so never reported as ignored.
    """
    if not isinstance(body, dict):
        return set()
    for name, harmless in table.items():
        value = _lookup(body, name)
        if value is None or (harmless is not None and harmless(value)):
            continue
        raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")
    return {name.split(".", 1)[0] for name in table}


def _lookup(body: dict[str, Any], name: str) -> Any:
    value: Any = body
    for part in name.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value
