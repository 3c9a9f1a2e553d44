"""engine: model loading, paged KV, contexts, scheduler, attention backends, samplers.

Knows nothing about HTTP or WASM. Import what you need from here::

    from engine import Model, Context, Sampler, max_tokens, eos
"""

# First: OpenMP wait settings must be in the environment before torch loads libgomp.
from engine import openmp_wait  # noqa: F401, I001
from engine import conveniences  # noqa: F401 - attaches model.embed, ctx.snapshot, ... (see its doc)
from engine.architectures import Architecture, TextInputs
from engine.attention import register as register_attention
from engine.attention_select import check_attention_choice, select_backend
from engine.beam import Hypothesis, beam_search
from engine.caption import caption, caption_async, caption_many, caption_many_async
from engine.checkpoint import (
    architecture_name,
    check_tokenizer,
    check_weights,
    default_device,
    load_part,
    load_pretrained,
    place_model,
    read_config,
    resolve_checkpoint,
)
from engine.completion import (
    ChoiceEvent,
    ChoiceResult,
    Completion,
    CompletionParams,
    PromptLogprob,
    Turn,
    complete,
)
from engine.context import Context, Distribution, Generation, TokenEvent
from engine.drafting import Drafter, DraftSpec, PromptLookupDrafter
from engine.embeddings import POOLINGS, embed_async, embed_counted_async, embed_many_async
from engine.errors import (
    ContextLengthExceededError,
    AdapterMismatchError,
    AdapterNotFoundError,
    AttentionBackendUnavailableError,
    CheckpointShapeError,
    ContextClosedError,
    EngineError,
    InvalidRequestError,
    MissingCheckpointFileError,
    ModelLoadError,
    NotASnapshotError,
    OutOfPagesError,
    QuantizationUnavailableError,
    SavedContextExistsError,
    SavedContextNotFoundError,
    SnapshotCorruptError,
    SnapshotModelMismatchError,
    UnsupportedArchitectureError,
)
from engine.forward import BatchedHead, ForwardRunner, StepInput
from engine.forward_pass import ForwardPass, ForwardPassError, PassOutput, media_position_span
from engine.brle import BrleError
from engine.grammar import Grammar, GrammarError, GrammarMatcher, GrammarUnavailableError
from engine.kv_pool import KVPool, PoolStats, bytes_per_page
from engine.lora import Adapter, AdapterStack
from engine.metrics import Histogram, MetricsSnapshot
from engine.model import Model
from engine.page_hashing import MediaRow
from engine.page_table import PageTable
from engine.penalties import Penalties
from engine.reasoning import ReasoningMarkers, ReasoningSplit, reasoning_markers
from engine.sampling import GREEDY_BELOW, Sampler, generator
from engine.slots import (
    Slot,
    SlotDistribution,
    SlotEmbedding,
    SlotEntropy,
    SlotLogits,
    SlotLogprobs,
    SlotOutput,
    SlotToken,
)
from engine.working_pages import WorkingPageError
from engine.startup_heap import (
    freeze_startup_heap,
    frozen_objects,
    frozen_startup_heap,
    unfreeze_startup_heap,
)
from engine.scheduler import Scheduler
from engine.stopping import StopCondition, StopReason, eos, eos_from, max_tokens, stop_strings
from engine.sync import SyncContext, run_sync
from engine.tool_calls import ParsedOutput, ToolCall, ToolCallFormat, check_tools, tool_call_format

__all__ = [
    "freeze_startup_heap",
    "frozen_objects",
    "frozen_startup_heap",
    "unfreeze_startup_heap",
    "Architecture",
    "BatchedHead",
    "ForwardRunner",
    "MediaRow",
    "PageTable",
    "Scheduler",
    "StepInput",
    "BrleError",
    "ForwardPass",
    "ForwardPassError",
    "PassOutput",
    "media_position_span",
    "Slot",
    "SlotDistribution",
    "SlotEmbedding",
    "SlotEntropy",
    "SlotLogits",
    "SlotLogprobs",
    "SlotOutput",
    "SlotToken",
    "WorkingPageError",
    "TextInputs",
    "bytes_per_page",
    "check_attention_choice",
    "register_attention",
    "select_backend",
    "NotASnapshotError",
    "SnapshotCorruptError",
    "SnapshotModelMismatchError",
    "AdapterMismatchError",
    "AdapterNotFoundError",
    "Adapter",
    "AdapterStack",
    "Histogram",
    "MetricsSnapshot",
    "Hypothesis",
    "DraftSpec",
    "Drafter",
    "PromptLookupDrafter",
    "Grammar",
    "GrammarError",
    "GrammarMatcher",
    "GrammarUnavailableError",
    "beam_search",
    "POOLINGS",
    "embed_async",
    "embed_counted_async",
    "embed_many_async",
    "ChoiceEvent",
    "ChoiceResult",
    "Completion",
    "CompletionParams",
    "Turn",
    "Penalties",
    "ReasoningMarkers",
    "ReasoningSplit",
    "reasoning_markers",
    "ParsedOutput",
    "ToolCall",
    "ToolCallFormat",
    "check_tools",
    "tool_call_format",
    "complete",
    "AttentionBackendUnavailableError",
    "QuantizationUnavailableError",
    "ContextLengthExceededError",
    "CheckpointShapeError",
    "Context",
    "ContextClosedError",
    "Distribution",
    "EngineError",
    "Generation",
    "InvalidRequestError",
    "KVPool",
    "MissingCheckpointFileError",
    "Model",
    "ModelLoadError",
    "OutOfPagesError",
    "PoolStats",
    "GREEDY_BELOW",
    "PromptLogprob",
    "Sampler",
    "SavedContextExistsError",
    "SavedContextNotFoundError",
    "StopCondition",
    "StopReason",
    "SyncContext",
    "TokenEvent",
    "UnsupportedArchitectureError",
    "architecture_name",
    "caption",
    "caption_async",
    "caption_many",
    "caption_many_async",
    "check_tokenizer",
    "check_weights",
    "default_device",
    "eos",
    "eos_from",
    "generator",
    "load_part",
    "load_pretrained",
    "max_tokens",
    "place_model",
    "read_config",
    "resolve_checkpoint",
    "run_sync",
    "stop_strings",
]
