"""One router per resource. ``ROUTERS`` are served under the API-key check; ``health``
(health, ready, metrics) is served without it."""

from api.http.routes import (
    batches,
    captions,
    chat,
    completions,
    embeddings,
    files,
    inferlets,
    jobs,
    media,
    models,
    pie_daemons,
    pie_programs,
    responses,
    speech,
    tokenize,
    transcriptions,
)

ROUTERS = [
    models.router,
    chat.router,
    responses.router,
    completions.router,
    media.router,
    captions.router,
    speech.router,
    transcriptions.router,
    jobs.router,
    files.router,
    batches.router,
    embeddings.router,
    inferlets.router,
    pie_programs.router,
    pie_daemons.router,
    tokenize.router,
]
