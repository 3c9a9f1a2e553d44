"""The served OpenAPI document, made to say what the server answers.

FastAPI documents a failed request validation as ``422`` with its own
``HTTPValidationError`` body, but this server answers it ``400`` in OpenAI's error shape
(``errors.py``), as the OpenAI API does. A client generated from the FastAPI default would
expect a status and a body that never come; schemathesis's ``status_code_conformance``
check found it on ``GET /v1/jobs?limit=0``. Only the document changes here: FastAPI has no
setting for the status it documents, so its schema is edited once, when first served.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI

_DEFAULT_422 = "#/components/schemas/HTTPValidationError"
_ERROR = "#/components/schemas/ErrorResponse"
_FASTAPI_ONLY = ("HTTPValidationError", "ValidationError")
_METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")


def _is_fastapi_default(response: dict[str, Any]) -> bool:
    schema = response.get("content", {}).get("application/json", {}).get("schema", {})
    return schema.get("$ref") == _DEFAULT_422


def validation_errors_as_400(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """``schema`` with every default 422 replaced by a 400 ``ErrorResponse`` (described by
    ``description`` where the route did not document a 400 of its own), and FastAPI's
    validation-error components dropped once nothing refers to them. Edits in place."""
    for ops in schema.get("paths", {}).values():
        for method, op in ops.items():
            if method not in _METHODS:
                continue
            responses = op.get("responses", {})
            if not _is_fastapi_default(responses.get("422", {})):
                continue
            del responses["422"]
            responses.setdefault(
                "400",
                {"description": description, "content": {"application/json": {"schema": {"$ref": _ERROR}}}},
            )
    components = schema.get("components", {}).get("schemas", {})
    for name in _FASTAPI_ONLY:
        if name not in components:
            continue
        others = {k: v for k, v in components.items() if k != name}
        text = json.dumps({"paths": schema.get("paths", {}), "components": others})
        if f'"#/components/schemas/{name}"' not in text:
            del components[name]
    return schema


def install_openapi(app: FastAPI, description: str) -> None:
    """Serve ``app``'s OpenAPI document with validation failures documented as 400."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = validation_errors_as_400(build(), description)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
