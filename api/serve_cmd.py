"""``pie-media serve``: the HTTP service under uvicorn."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_STATE_DIR = "pie-media-state"


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser(
        "serve", help="serve the models over HTTP (OpenAI-compatible chat, uploads, captions)"
    )
    sv.add_argument(
        "--model",
        dest="models",
        action="append",
        default=None,
        help="checkpoint directory or tiny model name; repeat to serve several (default: tiny)",
    )
    sv.add_argument(
        "--served-model-name",
        dest="served_model_names",
        action="append",
        default=None,
        help="name to serve the matching --model under (default: its directory name)",
    )
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="API keys: one per line, or named keys with roles (admin/user) and limits as TOML "
        "[[keys]] tables or JSON (README); also PIE_MEDIA_API_KEYS, comma-separated; required unless "
        "bound to loopback. Each key's stored objects are its own; SIGHUP re-reads the file",
    )
    sv.add_argument(
        "--audit-log",
        type=Path,
        default=None,
        help="append the audit lines (create/delete/cancel of stored objects, by key name) to this "
        "file (default: standard error)",
    )
    sv.add_argument(
        "--metrics-open",
        action="store_true",
        default=None,
        help="serve /metrics to any caller (default: it needs an admin key when there is one)",
    )
    sv.add_argument(
        "--share-prefix-cache",
        action="store_true",
        default=None,
        help="single-tenant deployments: reuse prefix-cache pages and encoder outputs across keys "
        "(default: only within one key's tenant)",
    )
    sv.add_argument(
        "--media-dir",
        "--state-dir",
        dest="state_dir",
        type=Path,
        default=Path(DEFAULT_STATE_DIR),
        help=f"uploads and their SQLite index live here (default: ./{DEFAULT_STATE_DIR})",
    )
    sv.add_argument(
        "--state-db",
        default=None,
        metavar="postgresql://...",
        help="keep the index of uploads, files, jobs and batches in this PostgreSQL database, "
        "shared by replicas (then --state-dir is a folder they all see; default: SQLite files there)",
    )
    sv.add_argument(
        "--allowed-media-domains",
        default=None,
        help="comma-separated hosts media URLs may name (default: any public host)",
    )
    sv.add_argument(
        "--allowed-local-media-path",
        type=Path,
        default=None,
        help="allow file:// media URLs under this folder (default: refused)",
    )
    sv.add_argument("--allow-http-media", action="store_true", help="also fetch http:// media URLs")
    sv.add_argument("--limit-mm-per-prompt", default=None, help="e.g. image=8,video=1,audio=2")
    sv.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight per model (then 429)"
    )
    sv.add_argument("--attention", default="auto", choices=["auto", "torch", "flashinfer"])
    sv.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: CUDA when available)")
    sv.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV pages (auto: bfloat16 on CUDA, float32 on the CPU)",
    )
    sv.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "fp8"],
        help="weight-only quantization of the language model at load (fp8: CUDA; an FP8 checkpoint loads as such)",
    )
    sv.add_argument("--kv-pages", type=int, default=None, help="KV pool pages per model")
    sv.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8"],
        help="what the KV pages store (auto: the model dtype; int8/fp8_e4m3: 8 bits + scales, "
        "~2x the rows of bfloat16 in the same memory; fp8_e4m3 runs on flashinfer, int8 on torch attention)",
    )
    sv.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="longest prompt + completion a chat model takes (default: its trained positions); "
        "past it: 400 context_length_exceeded",
    )
    sv.add_argument(
        "--encoder-cache-mib",
        type=int,
        default=None,
        metavar="MIB",
        help="media embeddings each text model keeps for repeated media (default 512; 0: none)",
    )
    sv.add_argument(
        "--prepared-cache-mib",
        type=int,
        default=None,
        metavar="MIB",
        help="prepared encoder inputs (resized, patched pixels) each text model keeps (default 1024; 0: none)",
    )
    sv.add_argument(
        "--decoded-media-cache-mib",
        type=int,
        default=None,
        metavar="MIB",
        help="decoded images and audio kept by content hash, server-wide (default 256; 0: none)",
    )
    sv.add_argument(
        "--max-speech-streams",
        default=None,
        metavar="N|auto",
        help="a cap on speech requests a CSM model generates at once, batched (default auto: its "
        "KV pages and measured frame time decide); past it: a stream 429, other requests wait in "
        "the queue",
    )
    sv.add_argument(
        "--speech-queue-size",
        type=int,
        default=None,
        metavar="N",
        help="speech requests without a real-time promise that may wait for admission (default 32); "
        "past it: 429 at once",
    )
    sv.add_argument(
        "--speech-queue-timeout",
        type=float,
        default=None,
        metavar="S",
        help="how long such a request waits at most, then 429 with Retry-After (default 30)",
    )
    sv.add_argument(
        "--speech-realtime-safety",
        type=_realtime_safety,
        default=None,
        metavar="F|off",
        help="admit a speech stream only if the measured frame time at the new batch size stays "
        "within F x a frame's audio length (default 0.8), so every stream keeps real time; else 429. "
        "off: pages (and --max-speech-streams) only",
    )
    sv.add_argument(
        "--cuda-graphs",
        type=int,
        default=None,
        metavar="N",
        help="replay decode passes of up to N contexts from CUDA graphs (flashinfer; default 0: off)",
    )
    sv.add_argument(
        "--inferlet-cache-dir",
        type=Path,
        default=None,
        help="compiled inferlet components are cached here (default: under --media-dir)",
    )
    sv.add_argument(
        "--max-inferlet-runs", type=int, default=None, help="inferlet runs going at once (then 429)"
    )
    sv.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH[@BASE]",
        help="serve PEFT LoRA adapters as models NAME on the chat model BASE (default: the first)",
    )
    sv.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding for every chat request, vLLM\'s shape: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}\' '
        '(a request\'s own "speculative" wins; "speculative": null turns it off)',
    )
    sv.add_argument(
        "--reasoning-parser",
        choices=["auto", "none"],
        default=None,
        help="auto: split every chat answer's thought channel (Gemma-4 <|channel>, Qwen3 <think>) "
        "into reasoning_content; none (default): only for requests with "
        'chat_template_kwargs {"enable_thinking": true}',
    )
    sv.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="serve through Ray Serve: engine replicas behind one HTTP entry, routed by prefix "
        "affinity then load (ADDRESS: a running cluster, e.g. ray://head:10001 or auto; none: a "
        "local Ray); share state with --state-db",
    )
    sv.add_argument(
        "--replicas", type=int, default=None, metavar="N", help="engine replicas with --ray (default 1)"
    )
    sv.add_argument("--log-level", default="info")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.http.app import create_app
    from api.http.security.keys import ApiKeys, require_keys_or_loopback
    from api.http.settings import ServeSettings

    values = {
        "models": args.models or ["tiny"],
        "served_model_names": args.served_model_names or [],
        "host": args.host,
        "port": args.port,
        "api_key_file": args.api_key_file,
        "metrics_open": getattr(args, "metrics_open", None),
        "audit_log": getattr(args, "audit_log", None),
        "share_prefix_cache": getattr(args, "share_prefix_cache", None),
        "state_dir": args.state_dir,
        "state_db": args.state_db,
        "allowed_media_domains": args.allowed_media_domains,
        "allowed_local_media_path": args.allowed_local_media_path,
        "allow_http_media": args.allow_http_media,
        "limit_mm_per_prompt": args.limit_mm_per_prompt,
        "max_concurrency": args.max_concurrency,
        "attention": args.attention,
        "device": args.device,
        "dtype": args.dtype,
        "kv_pages": args.kv_pages,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "cuda_graphs": args.cuda_graphs,
        "max_speech_streams": args.max_speech_streams,
        "speech_realtime_safety": getattr(args, "speech_realtime_safety", None),
        "speech_queue_size": getattr(args, "speech_queue_size", None),
        "speech_queue_timeout_s": getattr(args, "speech_queue_timeout", None),
        "max_model_len": args.max_model_len,
        "encoder_cache_mib": args.encoder_cache_mib,
        "prepared_cache_mib": args.prepared_cache_mib,
        "decoded_media_cache_mib": args.decoded_media_cache_mib,
        "lora_modules": args.lora_modules,
        "speculative_config": args.speculative_config,
        "reasoning_parser": args.reasoning_parser,
        "inferlet_cache_dir": args.inferlet_cache_dir,
        "max_inferlet_runs": args.max_inferlet_runs,
    }
    try:
        settings = ServeSettings(**{k: v for k, v in values.items() if v is not None})
        require_keys_or_loopback(ApiKeys.from_sources(settings.api_key_file), settings.host)
    except (ValueError, OSError) as e:
        print(f"pie-media serve: {e}", file=sys.stderr)
        return 2
    replicas = args.replicas if getattr(args, "replicas", None) is not None else 1
    if replicas < 1 or (getattr(args, "replicas", None) is not None and getattr(args, "ray", None) is None):
        print("pie-media serve: --replicas N (N >= 1) goes with --ray", file=sys.stderr)
        return 2
    if getattr(args, "ray", None) is not None:
        from api.serve_ray import run

        run(settings, address=args.ray or None, replicas=replicas, log_level=args.log_level)
        return 0
    from api.malloc_arenas import limit_malloc_arenas
    from media.errors import PieMediaError

    limit_malloc_arenas()  # a process that will serve: before its threads start (they take arenas)
    try:
        app = create_app(settings)
    except PieMediaError as e:  # e.g. the state database cannot be reached
        print(f"pie-media serve: {e.message}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        ws_per_message_deflate=settings.ws_compression,
    )
    return 0


def _realtime_safety(value: str) -> float | str:
    """``--speech-realtime-safety``: a share in (0, 1], or "off"."""
    if value.strip().lower() == "off":
        return "off"
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] or 'off', got {value!r}") from None
