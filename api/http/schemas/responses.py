"""Bodies of the Responses API (``/v1/responses``): OpenAI's request and response shapes,
the part of them this server serves (text, image and audio input; text output; function
tools; JSON formats; stored responses and ``previous_response_id``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.http.schemas.chat import MAX_MESSAGES, GrammarFormat, InputAudio, JsonSchemaSpec, RegexFormat


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputText(_Lenient):
    type: Literal["input_text", "output_text"]
    """``output_text``: an earlier assistant turn's text sent back as history."""
    text: str


class InputImage(_Lenient):
    type: Literal["input_image"]
    image_url: str = Field(
        max_length=64 * 1024 * 1024, description="data:, https:, pie-media:// or file:// URL"
    )
    detail: Literal["auto", "low", "high"] | None = None


class InputAudioPart(_Lenient):
    type: Literal["input_audio"]
    input_audio: InputAudio


InputContent = Annotated[InputText | InputImage | InputAudioPart, Field(discriminator="type")]


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputContent]


class FunctionCallItem(_Lenient):
    """A call an earlier response made, sent back with its output."""

    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str = Field(max_length=256)
    arguments: str


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Lenient):
    type: Literal["function"]
    name: str


class FormatText(_Lenient):
    type: Literal["text"]


class FormatJsonObject(_Lenient):
    type: Literal["json_object"]


class FormatJsonSchema(JsonSchemaSpec):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]


class TextConfig(_Lenient):
    format: (
        Annotated[
            FormatText | FormatJsonObject | FormatJsonSchema | RegexFormat | GrammarFormat,
            Field(discriminator="type"),
        ]
        | None
    ) = None
    """OpenAI's text / json_object / json_schema, and chat's extensions regex and grammar."""


class ReasoningConfig(_Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None
    """Accepted; thoughts come back whole (a ``reasoning`` item), not summarised."""


class ResponsesRequest(_Lenient):
    model: str
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    """Text (one user message) or items; at most ``MAX_MESSAGES`` items, as chat's messages."""
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    """An effort other than none / minimal turns the template's thinking on
    (``enable_thinking``) unless ``chat_template_kwargs`` says otherwise."""
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    # extensions, as on chat completions
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, max_length=32, description='extension (vLLM): e.g. {"enable_thinking": true}'
    )
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    cache_salt: str | None = Field(default=None, max_length=256, description="extension (vLLM), as on chat")
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)


# ---------------------------------------------------------------------------- response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A thinking model's thoughts (the thought channel), before its message."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["completed"] = "completed"


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed"] = "completed"


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    """No model served here reasons in a separate channel."""


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallOutput]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
