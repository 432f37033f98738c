"""Request bodies validated by their pydantic models, and the first error as one 400.

Every protocol's body is a pydantic model that ``/openapi.json`` documents and
``validated`` checks. The first validation error becomes one 400 whose
``param`` is the field's path, phrased the way the protocol's own API phrases
it (a ``Phrasing``):

- ``openai_error``: ``messages[1].content must be a string or an array of
  content parts, got 5``, with ``param`` ``messages[1].content``; values in
  their JSON spelling.
- ``anthropic_error``: ``messages.0.content.1.source.media_type: Input should
  be ...``, with ``param`` the same dotted path; values as Python shows them.

Unions of objects are chosen by a field's value (``tagged_union``), so an
error names the field inside the chosen member rather than every member's
failure; the tags are left out of the path. A field whose accepted values a
short phrase says better than pydantic's message wears ``accepts(phrase)``:
any failure inside it is one error carrying that phrase.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar, Union, get_args

from pydantic import AfterValidator, BaseModel, Discriminator, Tag, WrapValidator, create_model
from pydantic import ValidationError as PydanticValidationError
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import ErrorDetails, PydanticCustomError
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

from api.errors import ApiError, bad_request
from api.protocols.openai_common import show

Phrasing = Callable[[ErrorDetails], ApiError]

_TAG_SEPARATOR = "="  # union tags read "type=text"; no field name contains it
_UNKNOWN = "unknown_"  # error type prefix when no union member has that type or role
_ACCEPTS = "accepts"  # error type of a field wearing ``accepts``
_MAX_SHOWN = 80

_BodyT = TypeVar("_BodyT", bound=BaseModel)


def validated(model: type[_BodyT], body: Any, phrasing: Phrasing) -> _BodyT:
    """The body as ``model``, or the ``ApiError`` (400) for its first invalid field."""
    try:
        return model.model_validate(body)
    except PydanticValidationError as exc:
        raise phrasing(exc.errors(include_url=False)[0]) from None


def tagged_union(
    field: str,
    *members: type[BaseModel] | tuple[str, Any],
    where: str = "",
    implied: Callable[[dict[str, Any]], Any] | None = None,
    refused: Mapping[str, str] | None = None,
) -> Any:
    """A union of ``members`` chosen by the value of ``field`` (``type`` or ``role``).

    A member is a model whose ``field`` is a ``Literal``, or a ``(value, member)`` pair
    for one that is no such model (a union chosen by another field). A value no member
    has is an error naming ``field`` and the values accepted, followed by ``where``
    (`` in a user message``). ``implied`` gives the value of an object without ``field``
    (its other fields may say what it is). A ``refused`` value is one the protocol defines
    and the server does not serve: its error says the phrase the value maps to, and the
    schema leaves it out.
    """
    by_value: list[tuple[Any, Any]] = []
    for member in members:
        if isinstance(member, tuple):
            by_value.append(member)
        else:
            literal = member.model_fields[field].annotation
            by_value += [(value, member) for value in get_args(literal)]
    values = [value for value, _ in by_value]
    tagged = [Annotated[member, Tag(_tag(field, value))] for value, member in by_value]
    tagged += [
        Annotated[_refusal(field, phrase), Tag(_tag(field, value)), SkipJsonSchema()]
        for value, phrase in (refused or {}).items()
    ]

    def tag(value: Any) -> str | None:
        if not isinstance(value, dict):
            return None
        chosen = value.get(field)
        if chosen is None and implied is not None:
            chosen = implied(value)
        return _tag(field, chosen)

    # The error type carries the field (a dict context would make the type unhashable).
    discriminator = Discriminator(
        tag,
        custom_error_type=f"{_UNKNOWN}{field}",
        custom_error_message="one of " + ", ".join(map(repr, values)) + where,
    )
    return Annotated[Union[tuple(tagged)], discriminator]  # noqa: UP007 - a tuple built at runtime


def _tag(field: str, value: Any) -> str:
    return f"{field}{_TAG_SEPARATOR}{value}"


def _refusal(field: str, phrase: str) -> type[BaseModel]:
    """A model whose ``field`` refuses every value, saying it accepts ``phrase``."""

    def refuse(value: Any) -> Any:
        raise PydanticCustomError(_ACCEPTS, phrase)

    return create_model("Refused", **{field: (Annotated[Any, AfterValidator(refuse)], ...)})


_JSON_KINDS: dict[type, str] = {str: "string", list: "array", dict: "object"}


def by_json_kind(accepted: str, **members: Any) -> Any:
    """A union whose member is chosen by the value's JSON kind (``string``, ``array`` or
    ``object``); a value of another kind is one error saying the field accepts ``accepted``.

    An error inside the chosen member names the field inside it, as a plain union would not.
    """
    tagged = tuple(
        Annotated[member, Tag(f"json{_TAG_SEPARATOR}{kind}")] for kind, member in members.items()
    )

    def kind(value: Any) -> str | None:
        return f"json{_TAG_SEPARATOR}{_JSON_KINDS.get(type(value))}"

    discriminator = Discriminator(
        kind,
        custom_error_type=_ACCEPTS,
        custom_error_message=accepted,
    )
    return Annotated[Union[tagged], discriminator]  # noqa: UP007 - a tuple built at runtime


def accepts(phrase: str, *, integral: bool = False) -> WrapValidator:
    """Field metadata: any failure of the field is one error saying it accepts ``phrase``.

    With ``integral``, a float with no fraction (``16.0``) is read as the integer it
    spells, as JSON does not tell the two apart.
    """

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if integral and type(value) is float and value.is_integer():
            value = int(value)
        try:
            return handler(value)
        except PydanticValidationError:
            raise PydanticCustomError(_ACCEPTS, phrase) from None

    return WrapValidator(check)


# What a pydantic error type says a field accepts, in the OpenAI phrasing.
_OPENAI_ACCEPTED = {
    "bool_type": "true or false",
    "dict_type": "a JSON object",
    "float_type": "a number",
    "int_type": "an integer",
    "list_type": "an array",
    "model_type": "a JSON object",
    "string_too_short": "a non-empty string",
    "string_type": "a string",
}


def openai_error(error: ErrorDetails) -> ApiError:
    """``<path> must be <accepted>, got <value>`` (``<path> is required``), ``param`` the path.

    The path indexes arrays as ``messages[1].content`` does.
    """
    parts = _path_parts(error)
    value = error.get("input")
    kind = error["type"]
    accepted = _OPENAI_ACCEPTED.get(kind, error["msg"].removeprefix("Input should be "))
    if kind == _ACCEPTS:
        accepted = error["msg"]  # the phrase, as written: no context is formatted into it
    elif kind == "literal_error":
        accepted = f"one of {error['ctx']['expected']}"
    elif kind.startswith(_UNKNOWN):
        if isinstance(value, dict):  # the tag names no member: the tag field is the error
            parts.append(kind.removeprefix(_UNKNOWN))
            value = value.get(parts[-1])
        else:
            accepted = "a JSON object"
    path = "".join(
        f"[{part}]" if isinstance(part, int) else f".{part}" if index else part
        for index, part in enumerate(parts)
    )
    if not path:
        return bad_request(f"the request body must be a JSON object, got {show(value)}")
    if kind == "missing" or (value is None and isinstance(parts[-1], str)):
        return bad_request(f"{path} is required", path)
    return bad_request(f"{path} must be {accepted}, got {show(value)}", path)


def anthropic_error(error: ErrorDetails) -> ApiError:
    """``<dotted.path>: <what is wrong>, got <value>``, ``param`` the dotted path."""
    parts = [str(part) for part in _path_parts(error)]
    value = error.get("input")
    if error["type"].startswith(_UNKNOWN):
        field = error["type"].removeprefix(_UNKNOWN)
        if not isinstance(value, dict):
            message = f"must be an object, got {_repr(value)}"
        else:
            parts.append(field)
            message = f"must be {error['msg']}, got {_repr(value.get(field))}"
    elif error["type"] == "missing":
        message = "Field required"
    else:
        message = f"{error['msg']}, got {_repr(value)}"
    path = ".".join(parts)
    if not path:
        return bad_request(f"the request body must be a JSON object, got {_repr(value)}")
    return bad_request(f"{path}: {message}", path)


def _path_parts(error: ErrorDetails) -> list[str | int]:
    """The error's location without the union tags ``tagged_union`` adds."""
    return [part for part in error["loc"] if _TAG_SEPARATOR not in str(part)]


def _repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."
