"""Request and response bodies, one module per resource (OpenAI shapes where OpenAI has one)."""
