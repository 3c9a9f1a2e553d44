"""What the two text-generation routes share (``/v1/chat/completions`` and the legacy
``/v1/completions``): OpenAI sampling fields -> ``engine.CompletionParams`` with the same
checks and errors, and the per-token timing metrics."""

from __future__ import annotations

import time
from typing import Any

from api.http.deps import Service
from api.http.registry import ServedModel
from api.http.schemas.chat import PromptTokensDetails, ResponseFormat, Usage
from api.http.security.tenancy import ANONYMOUS, current_caller, enter
from api.http.settings import ServeSettings
from engine import (
    Completion,
    CompletionParams,
    DraftSpec,
    Grammar,
    InvalidRequestError,
    Penalties,
    ReasoningMarkers,
    Sampler,
    reasoning_markers,
)
from media.errors import PieMediaError


def completion_params(
    body: Any,
    service: Service,
    served: ServedModel,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    default_max_tokens: int | None = None,
) -> CompletionParams:
    """``body``: a request with OpenAI's sampling fields (temperature, top_p, n, seed,
    stop, presence/frequency_penalty, logit_bias) and the extensions (top_k, min_p,
    repetition_penalty, ignore_eos, response_format, speculative). ``max_tokens`` None: ``default_max_tokens``
    (else the server's default), cut to the room the prompt leaves."""
    penalties = penalties_of(body)
    if penalties is not None:
        penalties.check_vocab(served.model.arch.vocab_size)
    grammar = grammar_of(body.response_format)
    limit = service.settings.max_tokens_limit
    chosen = (
        max_tokens if max_tokens is not None else (default_max_tokens or service.settings.default_max_tokens)
    )
    if chosen > limit:
        raise InvalidRequestError(
            f"max_tokens is {chosen}, over this server's limit of {limit}",
            param="max_tokens",
            limit=limit,
            actual=chosen,
        )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 4 or any(not s for s in stop):
        raise InvalidRequestError("stop takes up to 4 non-empty strings", param="stop")
    return CompletionParams(
        sampler=sampler_of(body),
        max_tokens=chosen,
        stop=stop,
        n=body.n,
        seed=body.seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        ignore_eos=body.ignore_eos,
        grammar=grammar,
        penalties=penalties,
        adapters=((served.adapter, 1.0),) if served.adapter is not None else (),
        speculative=speculative_of(body, service.settings.speculative_config),
        max_tokens_is_default=max_tokens is None,
    )


def penalties_of(body: Any) -> Penalties | None:
    """OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token ids as
    strings), and vLLM's ``repetition_penalty``; None when none changes a logit."""
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            bias[int(key)] = float(value)
        except (TypeError, ValueError):
            raise InvalidRequestError(
                f"logit_bias keys are token ids, got {key!r}", param="logit_bias"
            ) from None
    penalties = Penalties.of(
        presence=body.presence_penalty or 0.0,
        frequency=body.frequency_penalty or 0.0,
        repetition=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=bias,
    )
    return penalties if penalties.active else None


def sampler_of(body: Any) -> Sampler:
    temperature = 1.0 if body.temperature is None else body.temperature
    if temperature == 0:
        return Sampler.greedy()
    top_k = body.top_k if body.top_k not in (None, 0, -1) else None
    if top_k is not None and top_k < 1:
        raise InvalidRequestError("top_k must be >= 1, or 0 / -1 to disable it", param="top_k")
    return Sampler(
        temperature=temperature,
        topk=top_k,
        topp=1.0 if body.top_p is None else body.top_p,
        minp=0.0 if body.min_p is None else body.min_p,
    )


def speculative_of(body: Any, default: dict[str, Any] | None) -> DraftSpec | None:
    """The request's own ``speculative`` (``null``: none), else the server's
    ``--speculative-config``."""
    spec = body.speculative
    if spec is None:
        if default is None or "speculative" in body.model_fields_set:
            return None
        return DraftSpec(**default)
    if spec.min_ngram > spec.max_ngram:
        raise InvalidRequestError("speculative.min_ngram must be <= max_ngram", param="speculative")
    return DraftSpec(spec.method, spec.num_draft, spec.max_ngram, spec.min_ngram)


def grammar_of(fmt: ResponseFormat | None) -> Grammar | None:
    """The token mask a ``response_format`` asks for, compiled now so that a bad schema is
    a 400 before anything runs (compiled grammars are cached)."""
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            grammar = Grammar.json()
        elif fmt.type == "json_schema":
            grammar = Grammar.json_schema(fmt.json_schema.schema_)
        elif fmt.type == "regex":
            grammar = Grammar.regex(fmt.regex)
        else:
            grammar = Grammar.lark(fmt.grammar)
        grammar.compiled()
    except PieMediaError as e:
        e.details.setdefault("param", "response_format")
        raise
    return grammar


def reasoning_of(
    settings: ServeSettings, model: Any, template_kwargs: dict[str, Any] | None
) -> ReasoningMarkers | None:
    """The thought markers to split a chat answer by: with ``--reasoning-parser auto``
    always, else only when the request turns thinking on (``enable_thinking``); None when
    the model's family has none."""
    if settings.reasoning_parser == "auto" or (template_kwargs or {}).get("enable_thinking"):
        return reasoning_markers(model)
    return None


def usage_of(completion: Completion) -> Usage:
    done = sum(completion.completion_tokens)
    return Usage(
        prompt_tokens=completion.prompt_tokens,
        completion_tokens=done,
        total_tokens=completion.prompt_tokens + done,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=completion.cached_tokens),
    )


class TokenTiming:
    """Time to first token and inter-token latency of one request, and its token counts,
    into the service's metrics."""

    def __init__(self, service: Service, name: str, started: float):
        self.service, self.name, self.started = service, name, started
        self.last: dict[int, float] = {}
        self.itl = service.metrics.itl.labels(name)  # looked up once, observed every token

    def token(self, index: int) -> None:
        now = time.perf_counter()
        if not self.last:
            self.service.metrics.ttft.labels(self.name).observe(now - self.started)
        elif index in self.last:
            self.itl.observe(now - self.last[index])
        self.last[index] = now

    def done(self, completion: Completion) -> None:
        m = self.service.metrics
        prompt, generated = completion.prompt_tokens, sum(completion.completion_tokens)
        m.prompt_tokens.labels(self.name).inc(prompt)
        m.generated_tokens.labels(self.name).inc(generated)
        caller = current_caller()
        if caller is not ANONYMOUS:
            m.key_tokens.labels(caller.name).inc(prompt + generated)
            self.service.key_limits.charge_tokens(caller, prompt + generated)


def scope_caches(service: Service, salt: str | None) -> None:
    """A request's ``cache_salt`` narrows its cache scope (vLLM's): from here on in this
    task, prefix pages and encoder outputs are shared only with requests of the same tenant
    and salt. Without a salt the bearer check's scope (the tenant) stands."""
    if salt is not None:
        enter(current_caller(), shared_caches=service.settings.share_prefix_cache, salt=salt)
