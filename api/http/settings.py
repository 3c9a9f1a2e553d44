"""One settings object for the service: CLI flags, environment (``PIE_MEDIA_*``) and the
API key file all land here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from media import DEFAULT_LIMITS

MEDIA_KINDS = ("image", "audio", "video")


def parse_mm_limits(text: str | dict[str, int] | None) -> dict[str, int]:
    """``"image=8,video=1,audio=2"`` -> ``{"image": 8, "video": 1, "audio": 2}``."""
    if text is None or isinstance(text, dict):
        out = dict(text or {})
    else:
        out = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            kind, sep, value = item.partition("=")
            if not sep or not value.strip().isdigit():
                raise ValueError(f"--limit-mm-per-prompt expects kind=N[,kind=N], got {item!r}")
            out[kind.strip()] = int(value)
    unknown = set(out) - set(MEDIA_KINDS)
    if unknown:
        raise ValueError(f"unknown media kind(s) {sorted(unknown)}; expected {', '.join(MEDIA_KINDS)}")
    return out


SPECULATIVE_KEYS = {
    "method": "method",
    "num_speculative_tokens": "num_draft",
    "prompt_lookup_max": "max_ngram",
    "prompt_lookup_min": "min_ngram",
}
"""``--speculative-config`` keys (vLLM's names) -> ``engine.DraftSpec`` fields."""


def parse_speculative_config(value: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`` in vLLM's
    shape -> ``engine.DraftSpec`` keyword arguments, checked (``ngram`` is vLLM's name for
    prompt lookup); None or ``{}``: no server-wide drafting."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON ({e.msg}): {value[:80]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
    if not value:
        return None
    unknown = sorted(set(value) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config: unknown key(s) {unknown}; known: {', '.join(SPECULATIVE_KEYS)}"
        )
    spec = {SPECULATIVE_KEYS[k]: v for k, v in value.items()}
    if spec.get("method", "ngram") not in ("ngram", "prompt_lookup"):
        raise ValueError(
            f"--speculative-config: method {spec['method']!r} is not served here; 'ngram' (prompt lookup) is"
        )
    spec["method"] = "prompt_lookup"
    from engine import DraftSpec

    DraftSpec(**spec)  # the numbers' own checks (InvalidRequestError is a ValueError)
    return spec


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PIE_MEDIA_", extra="ignore")

    models: list[str] = Field(default_factory=lambda: ["tiny"])
    """Checkpoint directories or tiny fixture names (``tiny``, ``tiny-gemma4``, ``tiny-csm``)."""
    served_model_names: list[str] = Field(default_factory=list)
    """Names to serve ``models`` under, in order (default: each directory's name)."""
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key_file: Path | None = None
    """Plain keys one per line, or named keys with roles and limits (TOML ``[[keys]]`` or
    JSON): ``api.http.security.keys.parse_key_file``. Re-read on SIGHUP."""
    audit_log: Path | None = None
    """Where the audit lines go (appended); default: standard error."""
    metrics_open: bool = False
    """``/metrics`` without an admin key (it needs one whenever the key file names one)."""
    share_prefix_cache: bool = False
    """Single-tenant: KV prefix pages and encoder outputs are reused across keys (by default
    only within one key's tenant, so a cache hit tells nobody what another key sent)."""
    state_dir: Path = Path("pie-media-state")
    """Uploads (files + SQLite index) live here and survive restarts."""
    state_db: str | None = None
    """``postgresql://...``: the index of uploads, files, jobs and batches in this database,
    shared by replicas (``state_dir`` then a folder they all see); default: SQLite files."""
    shared_state: bool = False
    """Several processes (replicas) use the state folder at once (set by ``--ray``)."""
    job_lease_s: float = Field(default=30.0, gt=0)
    """A job item claimed by a replica that stops renewing it is free again after this."""
    job_poll_s: float = Field(default=1.0, gt=0)
    """How often a replica looks for shared jobs to help with (shared index only)."""
    allowed_media_domains: list[str] = Field(default_factory=list)
    """Empty: any public host; else only these hosts (and their subdomains)."""
    allowed_local_media_path: Path | None = None
    """``file://`` URLs are served only from under this folder (off when unset)."""
    allow_http_media: bool = False
    allow_private_media_networks: bool = False
    """UNSAFE, for tests and closed networks: let media URLs reach private/loopback hosts."""
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=lambda: {"image": 8, "video": 1, "audio": 2})
    max_concurrency: int = Field(default=32, ge=1)
    """Requests in flight per model; past it the answer is 429 with Retry-After."""
    max_upload_bytes: int = Field(default=DEFAULT_LIMITS.max_bytes, ge=1)
    max_upload_files: int = Field(default=16, ge=1)
    max_job_upload_files: int = Field(default=1000, ge=1)
    """Files one multipart caption job may carry (each still under max_upload_bytes)."""
    max_job_upload_bytes: int = Field(default=2 << 30, ge=1)
    max_batch_file_bytes: int = Field(default=200 << 20, ge=1)
    """Size of one Batch API input file (OpenAI's limit is 200 MB)."""
    max_tokens_limit: int = Field(default=4096, ge=1)
    default_max_tokens: int = Field(default=256, ge=1)
    media_fetch_timeout_s: float = Field(default=10.0, gt=0)
    media_fetch_connect_timeout_s: float = Field(default=3.0, gt=0)
    attention: str = "auto"
    device: str | None = None
    """Where the models run (default: CUDA when available, else the CPU)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: bfloat16 on CUDA (the served families ship bfloat16 weights; flashinfer takes
    it), float32 on the CPU (where bfloat16 matmuls are slow)."""
    quantization: Literal["int8", "int4", "fp8"] | None = None
    """Weight quantization of the language models at load (``engine.quantization``); a
    checkpoint carrying an fp8 ``quantization_config`` loads as fp8 without it."""
    kv_pages: int | None = Field(default=None, ge=1)
    """KV pool pages per model (default: ``Model.load``'s memory budget)."""
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8"] = "auto"
    """What the text models' KV pages store (``Model.load(kv_dtype=...)``, ``engine.kv_quant``):
    auto = the model's dtype; int8 / fp8_e4m3 hold ~2-4x the rows per byte."""
    max_model_len: int | None = Field(default=None, ge=1)
    """The longest prompt plus completion a chat model takes (default: its trained position
    count); past it the request is a 400 ``context_length_exceeded``."""
    encoder_cache_mib: int = Field(default=512, ge=0)
    """Media embeddings each text model keeps for repeated media, in MiB (a repeat skips
    preparation and the tower); least recently used goes first; 0: none kept."""
    prepared_cache_mib: int = Field(default=1024, ge=0)
    """Prepared encoder inputs (resized, patched pixels) each text model keeps, in MiB,
    apart from the embeddings: a 12 MP photo prepares to ~290 MB of float32; 0: none kept."""
    decoded_media_cache_mib: int = Field(default=256, ge=0)
    """Decoded images and audio the server keeps by content hash, in MiB, so a client that
    sends the same bytes with every request decodes them once; 0: none kept."""
    cuda_graphs: int = Field(default=0, ge=0)
    """Replay decode passes of up to this many contexts from CUDA graphs (0: off)."""
    max_speech_streams: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    """A cap on speech requests one CSM model generates at once (batched); "auto": none
    beyond its KV pages and, with ``speech_realtime_safety``, its measured frame time. Past
    any bound the speech endpoint answers 429 (``speech.admission``)."""
    speech_realtime_safety: Literal["off"] | Annotated[float, Field(gt=0, le=1)] | None = 0.8
    """A speech stream is admitted only if the frame time measured at the resulting batch
    size stays within this share of a frame's audio length (CSM: 80 ms), so every stream
    keeps real time; "off" or None: no such rule. It guards streamed answers: a whole file
    (wav/flac, ``?stream=false``) joins the batch unless streams are running that it would
    put behind real time."""
    speech_queue_size: int = Field(default=32, ge=0)
    """Whole-file speech requests that may wait for admission at once per CSM model (past
    pages or ``max_speech_streams``); past it they get 429 at once (``speech.admission``).
    0: no queue (refused at once). ``PIE_MEDIA_SPEECH_QUEUE_SIZE``."""
    speech_queue_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """How long a speech request waits for admission; then 429 with Retry-After.
    ``PIE_MEDIA_SPEECH_QUEUE_TIMEOUT_S``."""
    max_inferlet_bytes: int = Field(default=64 << 20, ge=1)
    """Size of one uploaded inferlet component."""
    inferlet_cache_dir: Path | None = None
    """Where compiled inferlet components are cached (default: under ``state_dir``)."""
    inferlet_wall_s: float = Field(default=60.0, gt=0)
    max_inferlet_runs: int = Field(default=64, ge=1)
    """Inferlet runs going at once (each holds a thread while it runs); then 429."""
    """Wall-clock budget of one inferlet run (a request may ask for less)."""
    lora_modules: list[str] = Field(default_factory=list)
    """``NAME=PATH[@BASE]``: serve a PEFT LoRA adapter as model NAME on the served chat model
    BASE (default: the first one)."""

    speculative_config: dict[str, Any] | None = None
    """Speculative decoding for every chat request that does not set its own ``speculative``
    (``parse_speculative_config``: vLLM's JSON shape, prompt lookup); a request turns it
    off with ``"speculative": null``."""

    reasoning_parser: Literal["auto", "none"] = "none"
    """``auto``: every chat answer's thought channel (the model family's markers,
    ``engine.reasoning``) comes back as ``reasoning_content``; ``none``: only for requests
    that turn thinking on (``chat_template_kwargs.enable_thinking``). vLLM's flag."""
    pie_auth_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """Pie's protocol (the WebSocket at ``/``): a connection that has not authenticated after
    this long is closed."""
    ws_compression: bool = False
    """permessage-deflate on WebSockets (Pie's protocol). Off: its events are small msgpack
    frames, which compression makes dearer to send and to decode than to carry (bench/
    pie_protocol.py); a client that offers it gets plain frames."""
    pie_upload_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    """Pie's protocol: an ``add_program`` upload with no chunk for this long is answered
    ok:false (a stream that stopped part-way) and dropped."""

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative(cls, v: object) -> dict[str, Any] | None:
        return parse_speculative_config(v)  # type: ignore[arg-type]

    @field_validator("lora_modules")
    @classmethod
    def _lora(cls, v: list[str]) -> list[str]:
        from api.http.registry import parse_lora_module

        for spec in v:
            parse_lora_module(spec)  # a malformed spec stops the start with its message
        return v

    @field_validator("state_db")
    @classmethod
    def _state_db(cls, v: str | None) -> str | None:
        if v and not v.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"--state-db must be a postgresql:// URL, got {v.split(':', 1)[0]}:...")
        return v or None

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _mm(cls, v: object) -> dict[str, int]:
        return parse_mm_limits(v)  # type: ignore[arg-type]

    @field_validator("allowed_media_domains", "models", "served_model_names", "lora_modules", mode="before")
    @classmethod
    def _csv(cls, v: object) -> object:
        if isinstance(v, str):
            return [s.strip() for s in v.split(",") if s.strip()]
        return v

    def model_load_options(self) -> dict[str, Any]:
        """Keyword arguments for ``api.model_ref.load_model`` (``Model.load``'s options)."""
        import torch

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        named = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        on_cuda = torch.device(device).type == "cuda"
        dtype = named.get(self.dtype) or (torch.bfloat16 if on_cuda else torch.float32)
        out: dict[str, Any] = {"device": device, "dtype": dtype, "attention": self.attention}
        if self.kv_pages is not None:
            out["kv_pages"] = self.kv_pages
        if self.cuda_graphs:
            out["cuda_graphs"] = self.cuda_graphs
        if self.quantization:
            out["quantization"] = self.quantization
        if self.kv_cache_dtype != "auto":
            out["kv_dtype"] = self.kv_cache_dtype
        if self.max_model_len is not None:
            out["max_model_len"] = self.max_model_len
        out["max_speech_streams"] = self.max_speech_streams
        out["speech_realtime_safety"] = (
            None if self.speech_realtime_safety == "off" else self.speech_realtime_safety
        )
        from encoders import EncoderCache

        out["encoder_cache"] = EncoderCache(  # one per call: each model its own budget
            byte_budget=self.encoder_cache_mib << 20, prepared_byte_budget=self.prepared_cache_mib << 20
        )
        return out

    @property
    def media_dir(self) -> Path:
        return self.state_dir / "media"
