"""The request bodies of the OpenAI and Anthropic routes, as pydantic models (the Responses
API's, closed to unknown fields, are in `responses_input.py`).

Strict: a string where a number belongs is a 400, not a silent conversion. Unknown fields are
ignored, as the hosted APIs' clients send fields we do not use; fields we know but do not serve
are refused by the routes. Ranges are checked by the `settings` validators, as for the CLI and
the API (`errors.validation_error` words the 400).
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from .. import settings as check


def _setting(validator):
    """A field type's check by one of `settings`' validators (named by the 400, not by it)."""
    return AfterValidator(lambda value: validator(value))


MaxTokens = Annotated[int, _setting(check.max_tokens)]
Temperature = Annotated[float, _setting(check.temperature)]
TopP = Annotated[float, _setting(check.top_p)]
TopK = Annotated[int, _setting(check.top_k)]
Seed = Annotated[int, _setting(check.seed)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Optional[str] = None


class ImageURLPart(_Strict):
    """OpenAI chat's image part: a data: URL (base64), or an http(s) URL."""
    type: Literal["image_url"]
    image_url: Union[ImageURL, str]

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class AnthropicImageSource(_Strict):
    type: Literal["base64", "url"]
    media_type: Optional[str] = None
    data: Optional[str] = None
    url: Optional[str] = None


class AnthropicImagePart(_Strict):
    type: Literal["image"]
    source: AnthropicImageSource
    cache_control: Optional[dict] = None


ChatPart = Annotated[Union[TextPart, ImageURLPart], Field(discriminator="type")]
ToolResultPart = Annotated[Union[TextPart, AnthropicImagePart], Field(discriminator="type")]


def content_text(content) -> str:
    """A message's content (a string, text parts or None) as one string (image parts are
    taken by `content_parts`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if p.type in ("text", "input_text", "output_text"))


class ToolFunction(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: ToolFunction


class CalledFunction(_Strict):
    name: str
    arguments: Union[str, dict]


class ToolCall(_Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ChatPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    # an assistant turn's reasoning, sent back (vLLM's and mlx-lm's names)
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class StreamOptions(_Strict):
    include_usage: bool = False


class NamedFunction(_Strict):
    name: str


class NamedTool(_Strict):
    """tool_choice naming a function; the model still decides (the server cannot force it)."""
    type: Literal["function"]
    function: NamedFunction


class _OpenAISampling(_Strict):
    model: str
    max_tokens: Optional[MaxTokens] = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0                                    # extension, as mlx-lm's server
    seed: Optional[Seed] = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Union[bool, int]] = None        # refused when asked for (not served)


class ChatRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[MaxTokens] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedTool, None] = None
    top_logprobs: Optional[int] = None                 # refused when asked for (not served)
    reasoning_effort: Optional[str] = None             # "none" / "minimal": thinking off
    chat_template_kwargs: Optional[dict] = None        # mlx-lm's and vLLM's extension


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False
    best_of: Optional[int] = None                      # refused above 1
    suffix: Optional[str] = None                       # refused when given (no infilling)


class AnthropicBlock(_Strict):
    """text, tool_use and thinking (assistant turns), image and tool_result (user turns)
    content blocks; redacted_thinking blocks are taken and left out (this server makes none)."""
    type: Literal["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: Optional[str] = None
    thinking: Optional[str] = None
    signature: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict] = None
    tool_use_id: Optional[str] = None
    content: Union[str, list[ToolResultPart], None] = None
    source: Optional[AnthropicImageSource] = None      # an image block's


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant", "system"]       # system: Claude Code sends it mid-turns
    content: Union[str, list[AnthropicBlock]]


class AnthropicTool(_Strict):
    """A client tool (`type` absent or "custom"); Anthropic's own tool types (web_search_...,
    bash_..., ...) are left out of the prompt by the route."""
    type: Optional[str] = None
    name: str
    description: Optional[str] = None
    input_schema: dict = Field(default_factory=dict)


class AnthropicToolChoice(_Strict):
    """auto, any and a named tool leave the choice to the model; none offers no tools."""
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingConfig(_Strict):
    """Thinking on ("enabled", "adaptive": the model decides how long) or off; the budget is
    the model's to keep (not enforced)."""
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request. Fields such as
    context_management, output_config, metadata and cache_control are ignored."""
    model: str
    thinking: Optional[ThinkingConfig] = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[TextPart], None] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: MaxTokens                              # clamped to what the server can give
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    metadata: Optional[dict] = None
