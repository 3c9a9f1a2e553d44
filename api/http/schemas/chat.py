"""Request and response bodies (OpenAI shapes where OpenAI has one).

Unknown request fields are ignored, as the OpenAI API and vLLM do; fields we know but
cannot honour (``suffix``, ``best_of`` != n) are refused with a 400 by the route, never silently
dropped. ``response_format`` takes OpenAI's text / json_object / json_schema and two
extensions, regex and grammar (Lark): each becomes a token mask (``engine.grammar``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# ------------------------------------------------------------------ chat completions: request

MAX_MESSAGES = 2048
"""Messages in one chat request (OpenAI answers more with a 400 too)."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Lenient):
    url: str = Field(max_length=64 * 1024 * 1024)
    detail: Literal["auto", "low", "high"] | None = None


class VideoURL(_Lenient):
    url: str = Field(max_length=256 * 1024 * 1024)


class InputAudio(_Lenient):
    data: str = Field(max_length=128 * 1024 * 1024, description="base64 audio bytes")
    format: str = Field(max_length=16, description="wav, mp3, flac, ogg, ...")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


class AudioPart(_Lenient):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoPart(_Lenient):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | AudioPart | VideoPart, Field(discriminator="type")]


class FunctionCall(_Lenient):
    name: str = Field(max_length=256)
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallIn(_Lenient):
    """A call an earlier assistant message made (sent back with the conversation)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class TextFormat(_Lenient):
    type: Literal["text"]


class JsonObjectFormat(_Lenient):
    type: Literal["json_object"]


class JsonSchemaSpec(_Lenient):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Lenient):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(_Lenient):
    """Extension: the reply matches this regex as a whole."""

    type: Literal["regex"]
    regex: str = Field(max_length=256 * 1024)


class GrammarFormat(_Lenient):
    """Extension: the reply is a sentence of this Lark grammar (llguidance's dialect)."""

    type: Literal["grammar"]
    grammar: str = Field(max_length=256 * 1024)


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat,
    Field(discriminator="type"),
]


class SpeculativeOptions(BaseModel):
    """Extension: speculative decoding. Each pass also checks up to ``num_draft`` tokens a
    prompt-lookup drafter copies from earlier in the conversation (the latest match of its
    last ``max_ngram`` .. ``min_ngram`` tokens); the output is what it would be without."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["prompt_lookup"] = "prompt_lookup"
    num_draft: int = Field(default=4, ge=1, le=32)
    max_ngram: int = Field(default=3, ge=1, le=16)
    min_ngram: int = Field(default=1, ge=1, le=16)


class GenerationRequest(_Lenient):
    """The sampling and streaming fields chat and legacy completions share (OpenAI's, and
    vLLM's extensions); ``api.http.generation.completion_params`` reads them."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, description="extension (vLLM): -1 or 0 disables")
    min_p: float | None = Field(default=None, ge=0, le=1, description="extension (vLLM)")
    ignore_eos: bool = Field(default=False, description="extension (vLLM): generate through EOS")
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    cache_salt: str | None = Field(
        default=None,
        max_length=256,
        description="extension (vLLM): prefix-cache pages are shared only among requests with the same "
        "salt (and, unless the server shares caches, the same key's tenant)",
    )
    """A 64-bit integer, as in OpenAI's schema."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        default=None, gt=0, le=10, description="extension (vLLM, transformers): 1 disables it"
    )
    logit_bias: dict[str, float] | None = Field(
        default=None, description="token id (as a string) -> [-100, 100]"
    )
    response_format: ResponseFormat | None = None
    speculative: SpeculativeOptions | None = Field(
        default=None,
        description="extension: drafts checked per pass (default: the server's "
        "--speculative-config; null: none for this request)",
    )
    user: str | None = None


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    """At most ``MAX_MESSAGES``, OpenAI's own limit."""
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """OpenAI's default: "auto" with tools, "none" without."""
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description='extension (vLLM): keywords for the chat template, e.g. {"enable_thinking": true}',
        max_length=32,
    )


# ------------------------------------------------------------------ chat completions: response


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    """A thinking model's thoughts, split from the answer (vLLM's field)."""
    tool_calls: list[ToolCallOut] | None = None
    """The calls the model made (with ``tools``); left out otherwise."""


FinishReason = Literal["stop", "length", "tool_calls"]


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens whose K/V came from the prefix cache (not computed again)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class DeltaToolCall(ToolCallOut):
    index: int


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


# ------------------------------------------------------------------ models, media, captions


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pie-media"
    kind: Literal["chat", "speech"]
    architecture: str
    media_kinds: list[str]
    parent: str | None = None
    """For a LoRA adapter served with ``--lora-modules``: the base model's name."""
    max_model_len: int | None = None
    """A chat model's longest prompt plus completion (``--max-model-len``), as vLLM reports it."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class MediaObject(BaseModel):
    id: str
    object: Literal["media"] = "media"
    kind: Literal["image", "audio", "video"]
    filename: str | None
    content_type: str | None
    bytes: int
    content_hash: str
    created_at: int
    metadata: dict[str, Any]
    token_counts: dict[str, int | None] = Field(
        default_factory=dict,
        description="tokens each loaded model would spend on it (null: it cannot take it)",
    )


class MediaUploadResult(BaseModel):
    """One file of an upload: the stored object, or the typed error that refused it."""

    filename: str | None
    media: MediaObject | None = None
    error: dict[str, Any] | None = None


class MediaUploadResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[MediaUploadResult]


class MediaDeleted(BaseModel):
    id: str
    object: Literal["media"] = "media"
    deleted: bool


class CaptionResult(BaseModel):
    filename: str | None
    caption: str | None = None
    error: dict[str, Any] | None = None
    usage: Usage | None = None


class CaptionResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[CaptionResult]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
