"""The few words the stores' one SQL text leaves to each dialect (``{REAL}``, ``{SERIAL}``).

Below both index backends (``index_db.SqliteIndex``, ``index_postgres.PostgresIndex``), so
neither imports the other."""

from __future__ import annotations


def fill_words(schema: str, words: dict[str, str]) -> str:
    """``{REAL}`` / ``{SERIAL}`` in a schema -> this dialect's words."""
    for word, text in words.items():
        schema = schema.replace("{" + word + "}", text)
    return schema
