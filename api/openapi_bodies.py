"""Request bodies in ``/openapi.json`` for routes whose handlers read the body themselves.

Every POST handler takes the raw ``Request`` and hands its body to the protocol's
own parser, which validates it (against the very model documented here, where the
protocol has one that validates) and refuses a bad field with the exact 400 that
protocol's clients expect. FastAPI therefore sees no body parameter and documents
none. ``json_body``
and ``form_body`` give a route the ``openapi_extra`` that documents a pydantic
model as its body without FastAPI validating anything, and ``document_bodies``
moves the models' shared definitions into ``components.schemas`` where ``/docs``
resolves them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF_PREFIX = "#/components/schemas/"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting ``model`` as the route's required JSON body."""
    return _body(model, "application/json")


def form_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting ``model`` as the route's required multipart form."""
    return _body(model, "multipart/form-data")


def _body(model: type[BaseModel], media_type: str) -> dict[str, Any]:
    """The body's schema; its first example, if any, is what ``/docs`` fills the form with."""
    schema = model.model_json_schema(ref_template=REF_PREFIX + "{model}")
    media: dict[str, Any] = {"schema": schema}
    if schema.get("examples"):
        media["example"] = schema["examples"][0]
    return {"requestBody": {"required": True, "content": {media_type: media}}}


def document_bodies(app: FastAPI) -> None:
    """Make ``app.openapi`` hoist each documented body into ``components.schemas``.

    A body's schema (with its ``$defs``) becomes a component named by its title, and the
    operation refers to it. Two different schemas under one name raise ``ValueError``:
    a reference would otherwise resolve to the wrong model.
    """
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _hoisted(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _hoisted(generated: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``generated``: the operations hold the routes' own ``openapi_extra``."""
    document = copy.deepcopy(generated)
    schemas: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            content = operation.get("requestBody", {}).get("content", {})
            for media in content.values():
                schema = media["schema"]
                if "$ref" in schema:
                    continue
                for name, definition in schema.pop("$defs", {}).items():
                    _add(schemas, name, definition)
                _add(schemas, schema["title"], schema)
                media["schema"] = {"$ref": REF_PREFIX + schema["title"]}
    return document


def _add(schemas: dict[str, Any], name: str, schema: dict[str, Any]) -> None:
    if schemas.get(name, schema) != schema:
        raise ValueError(f"two request schemas are both named {name!r}")
    schemas[name] = schema
