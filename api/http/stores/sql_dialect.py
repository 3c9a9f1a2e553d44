"""The few words the stores' one SQL text leaves to each dialect (``{REAL}``, ``{SERIAL}``).

Below both index backends (``index_db.SqliteIndex``, ``index_postgres.PostgresIndex``), so
neither imports the other."""

from __future__ import annotations


def fill_words(schema: str, words: dict[str, str]) -> str:
    """``{REAL}`` / ``{SERIAL}`` in a schema -> this dialect's words."""
    for word, text in words.items():
        schema = schema.replace("{" + word + "}", text)
    return schema


def tenant_clause(scope: str | None, column: str = "tenant") -> tuple[str, tuple[str, ...]]:
    """``" AND tenant = ?"`` and its parameter for a caller limited to ``scope``; nothing for
    an admin (``scope`` None). Built here rather than as ``? IS NULL OR ...``, which
    PostgreSQL refuses for an untyped NULL parameter."""
    if scope is None:
        return "", ()
    return f" AND {column} = ?", (scope,)
