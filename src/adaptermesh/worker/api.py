"""The worker's OpenAI request and response bodies as pydantic models.

Requests are validated strictly (no coercion: ``"1"`` is not an integer, ``true`` is not a
number, floats must be finite) and refuse unknown fields, so a misspelt ``max_token`` is an
error naming it instead of a silently ignored option. ``request_error`` turns pydantic's first
error into the service's ``(param, code, message)``: ``param`` is the field's path
(``messages[0].content``), ``code`` one of ``missing_field``, ``invalid_type``,
``invalid_value``, ``invalid_unicode``, ``unknown_field``, ``unsupported``.

Logprobs: completions take ``logprobs`` (an integer in [0, MAX_LOGPROBS]: the sampled token's
logprob plus that many alternatives); chat takes ``logprobs: true`` with an optional
``top_logprobs`` in [0, MAX_LOGPROBS], which needs ``logprobs: true``.

Served as vLLM serves them: ``logit_bias`` (token id, as a decimal string key, to a bias in
[-100, 100], at most MAX_LOGIT_BIAS entries; both endpoints), ``best_of`` (n <= best_of <=
MAX_BEST_OF candidates, the n with the highest cumulative logprob answered; not with
``stream``), and on completions ``echo`` (the prompt before each choice's text; not with
``logprobs``, as prompt logprobs are not computed) and ``suffix`` (fill-in-the-middle, only on a
model whose tokenizer has FIM tokens: the service checks). The output constraints
(``response_format``, vLLM's ``structured_outputs`` and ``guided_*``) and chat's ``tools`` /
``tool_choice`` pass through as sent and are checked where they are used
(``structured_request.py``, ``tool_calls.py``), with a 400 naming the field. Response models
(``Usage``, the choices, the chunks) document the wire shapes; the streaming path writes
pre-encoded chunks of the same shape.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from adaptermesh.assignment_rules import MAX_QUOTED, quote
from adaptermesh.worker.merge_spec import MERGE_FIELD, MergeSpec, MergeSpecError, parse_merge_spec
from adaptermesh.worker.sampling import BOUNDS
from adaptermesh.worker.types import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS

__all__ = [
    "MAX_BEST_OF",
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_VALUE",
    "MAX_LOGPROBS",
    "MAX_N",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "LoadLoraAdapterRequest",
    "StreamOptions",
    "UnloadLoraAdapterRequest",
    "Usage",
    "check_logit_bias",
    "request_error",
]

# Choices one request may ask for (each is one engine sequence).
MAX_N = 16
# Candidates one request may generate with best_of (each is one engine sequence): OpenAI's cap.
MAX_BEST_OF = 20
# The longest suffix (characters) a fill-in-the-middle request may send.
MAX_SUFFIX_CHARS = 1 << 20
# The most stop sequences one request may carry (OpenAI's limit), and their length.
MAX_STOP = 4
MAX_STOP_CHARS = 256
# Names (model, lora_name) and path components: NAME_MAX on Linux; a whole path: PATH_MAX.
MAX_NAME_CHARS = 255
MAX_PATH_CHARS = 4096
# top_k is an int32 on the device; -1 (vLLM's "off") is accepted as 0.
MAX_TOP_K = BOUNDS.max_top_k

StrictInt = Annotated[int, Strict()]
StrictBool = Annotated[bool, Strict()]


# The sampling parameters' limits are the sampler's (sampling.BOUNDS), which the engine checks
# every request against too.
Temperature = Annotated[
    float, Strict(), Field(**BOUNDS.temperature.field_limits(), allow_inf_nan=False)
]
TopP = Annotated[float, Strict(), Field(**BOUNDS.top_p.field_limits(), allow_inf_nan=False)]
TypicalP = Annotated[float, Strict(), Field(**BOUNDS.typical_p.field_limits(), allow_inf_nan=False)]
MinP = Annotated[float, Strict(), Field(**BOUNDS.min_p.field_limits(), allow_inf_nan=False)]
Penalty = Annotated[
    float, Strict(), Field(**BOUNDS.presence_penalty.field_limits(), allow_inf_nan=False)
]
RepetitionPenalty = Annotated[
    float, Strict(), Field(**BOUNDS.repetition_penalty.field_limits(), allow_inf_nan=False)
]


def _error(code: str, message: str, at: str = "") -> PydanticCustomError:
    """A validation error of type ``code``; ``at`` is a path below the field (``[2]``)."""
    return PydanticCustomError(code, message, {"at": at} if at else None)


def check_text(value: str) -> str:
    """Refuse strings that are not valid Unicode (a lone UTF-16 surrogate such as "\\ud800")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _error(
            "invalid_unicode", f"holds a lone surrogate at index {exc.start}; send valid Unicode"
        ) from None
    return value


def check_name(value: str, max_chars: int = MAX_NAME_CHARS) -> str:
    if not value:
        raise _error("invalid_value", "must not be empty")
    if len(value) > max_chars:
        raise _error("invalid_value", f"must have at most {max_chars} characters, got {len(value)}")
    if "\0" in value:
        raise _error("invalid_value", "must not contain NUL characters")
    return check_text(value)


def check_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(token id, bias)`` pairs: an object (or null) of at most
    MAX_LOGIT_BIAS entries, each key a token id in decimal, each value a finite number in
    [-MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE]. Whether the ids are in the vocabulary is
    the engine's check."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _error(
            "invalid_type", f"must be an object of token id to bias, got {type(value).__name__}"
        )
    if len(value) > BOUNDS.max_logit_bias:
        raise _error(
            "invalid_value", f"may bias at most {BOUNDS.max_logit_bias} tokens, got {len(value)}"
        )
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        text = str(key)
        if not (text.isascii() and text.isdigit()) or len(text) > 10:
            raise _error(
                "invalid_value",
                f"keys must be token ids (non-negative integers), got {quote(text)}",
            )
        if type(bias) not in (int, float) or (type(bias) is float and not math.isfinite(bias)):
            raise _error(
                "invalid_type",
                f"the bias of token {text} must be a finite number, got {type(bias).__name__}",
            )
        if bias not in BOUNDS.logit_bias:
            raise _error(
                "invalid_value",
                f"the bias of token {text} must be in {BOUNDS.logit_bias.describe()}, "
                f"got {quote(repr(bias))}",
            )
        token = int(text)
        if token in pairs:
            raise _error("invalid_value", f"token {token} is named twice")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _unsupported(what: str) -> PydanticCustomError:
    return _error("unsupported", f"{what} is not supported by this server (only the default is)")


def _default_only(value: bool, info: ValidationInfo) -> bool:
    """A flag this server accepts only off, its default."""
    if value:
        raise _unsupported(str(info.field_name))
    return value


# A name (model, adapter): check_name; a flag accepted only off.
Name = Annotated[str, Strict(), AfterValidator(check_name)]
DefaultOnly = Annotated[bool, Strict(), AfterValidator(_default_only)]


# The checks of one field's value, declared with the field's type; the checks that read other
# fields are the models' field validators.
def _merge_spec(value: Any) -> MergeSpec | None:
    if value is None:
        return None
    try:
        return parse_merge_spec(value)
    except MergeSpecError as exc:
        raise _error("invalid_value", exc.message, at=exc.param[len(MERGE_FIELD) :]) from None


def _model_name(value: str) -> str:
    # "" means the base model, as before; anything else must be a usable name.
    return value if not value else check_name(value)


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _error("invalid_type", "must be a string or a list of strings")
    if len(items) > MAX_STOP:
        raise _error("invalid_value", f"at most {MAX_STOP} sequences are allowed, got {len(items)}")
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise _error(
                "invalid_value", f"each sequence must have 1 to {MAX_STOP_CHARS} characters"
            )
        check_text(s)
    return tuple(items)


def _completion_logprobs(value: Any) -> int | None:
    if value is None or value is False:
        return None
    if type(value) is not int:
        raise _error(
            "invalid_type",
            f"must be an integer in [0, {MAX_LOGPROBS}], got {type(value).__name__}",
        )
    if not 0 <= value <= MAX_LOGPROBS:
        raise _error("invalid_value", f"must be in [0, {MAX_LOGPROBS}], got {value}")
    return value


def _fim_suffix(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _error("invalid_type", f"must be a string, got {type(value).__name__}")
    if len(value) > MAX_SUFFIX_CHARS:
        raise _error(
            "invalid_value",
            f"must have at most {MAX_SUFFIX_CHARS} characters, got {len(value)}",
        )
    return check_text(value)


def _prompt(prompt: Any) -> str | list[int]:
    """A string, a list of token ids, or a batch of exactly one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _error("invalid_value", "must not be empty")
        return check_text(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise _error("invalid_value", "must not be empty")
        if all(type(t) is int for t in prompt):
            if any(t < 0 for t in prompt):
                raise _error("invalid_value", "token ids must not be negative")
            return list(prompt)
        if all(isinstance(p, str | list) for p in prompt):
            raise _error(
                "unsupported",
                f"batches of prompts are not supported (got "
                f"{len(prompt)}); send one request per prompt",
            )
        raise _error("invalid_type", "must be a string or a list of integer token ids")
    if prompt is None:
        raise _error("missing_field", "is required")
    raise _error(
        "invalid_type", f"must be a string or a list of token ids, got {type(prompt).__name__}"
    )


def _message_content(content: Any) -> str:
    if isinstance(content, list):
        # Content parts: only text parts can go through a text-only model.
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _error(
                    "unsupported",
                    'only {"type": "text", "text": ...} parts are supported',
                    at=f"[{j}]",
                )
            texts.append(part["text"])
        content = "".join(texts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise _error("invalid_type", "must be a string or a list of text parts")
    return check_text(content)


def _optional_bool(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise _error("invalid_type", "must be a boolean")
    return value


def _adapter_path(value: str) -> str:
    check_name(value, MAX_PATH_CHARS)
    longest = max(len(part.encode()) for part in value.split("/"))
    if longest > MAX_NAME_CHARS:
        raise _error(
            "invalid_value",
            f"each path component must have at most {MAX_NAME_CHARS} bytes, one has {longest}",
        )
    return value


def _chat_field(value: Any) -> None:
    if value is not None:
        raise _error("unknown_field", "is a chat completions field; completions take logprobs")
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    # OpenAI's newer option: usage on every chunk; accepted only off.
    continuous_usage_stats: DefaultOnly = False


class _Sampling(_Body):
    """Fields both generation endpoints share."""

    model: Annotated[str, Strict(), AfterValidator(_model_name)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1
    # OpenAI's default temperature is 1; clients that want greedy decoding send 0.
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Strict(), Field(ge=-1, le=MAX_TOP_K)] = 0
    min_p: MinP = 0.0
    # Locally typical sampling (vLLM's and transformers' typical_p); 1 = off.
    typical_p: TypicalP = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    # Any integer: the engine uses its low 64 bits.
    seed: StrictInt | None = None
    stop: Annotated[Any, AfterValidator(_stop_sequences)] = ()
    max_tokens: StrictInt | None = None
    user: (
        Annotated[str, Strict(), Field(max_length=MAX_PATH_CHARS), AfterValidator(check_text)]
        | None
    ) = None
    # {token id: bias}; held as sorted (id, bias) pairs.
    logit_bias: Annotated[Any, AfterValidator(check_logit_bias)] = Field(
        default=None, validate_default=True
    )
    best_of: Any = None
    # Output constraints (structured_request.py checks them): OpenAI's and vLLM's fields.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # A merge of several adapters for this request (merge_spec.py, docs/worker-service.md):
    # {ids, weights, merge_strategy, density, majority_sign_method, seed}.
    merged_adapters: Annotated[Any, AfterValidator(_merge_spec)] = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: Any, info: ValidationInfo) -> int | None:
        # n and stream come first (field order); when one failed, its own error comes first.
        if value is None:
            return None
        if type(value) is not int:
            raise _error("invalid_type", f"must be an integer, got {type(value).__name__}")
        n = info.data.get("n", 1)
        if not n <= value <= MAX_BEST_OF:
            raise _error("invalid_value", f"must be in [n, {MAX_BEST_OF}] (n is {n}), got {value}")
        if value > n and info.data.get("stream"):
            raise _error(
                "invalid_value",
                "above n cannot be streamed: the candidates are ranked after they finish",
            )
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Annotated[Any, AfterValidator(_prompt)] = Field(default=None, validate_default=True)
    # None (or false): no logprobs; k: the sampled token's logprob and the k most likely.
    logprobs: Annotated[Any, AfterValidator(_completion_logprobs)] = None
    top_logprobs: Annotated[Any, AfterValidator(_chat_field)] = None
    echo: StrictBool = False
    suffix: Annotated[Any, AfterValidator(_fim_suffix)] = None

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token for the engine, or None when no logprobs are asked for."""
        return self.logprobs if isinstance(self.logprobs, int) else None

    @field_validator("echo", mode="before")
    @classmethod
    def _echo(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return False
        # logprobs comes first (field order); when it failed, its own error comes first.
        if value is True and info.data.get("logprobs") is not None:
            raise _error(
                "unsupported",
                "with logprobs is not supported: this server does not compute the "
                "prompt's logprobs; send echo or logprobs, not both",
            )
        return value


class ChatMessage(_Body):
    # Other message fields are ignored, not refused: chat clients send back what the server
    # answered. An assistant's tool_calls and a tool message's tool_call_id (and name) go to the
    # chat template; tool_calls.py checks them.
    model_config = ConfigDict(extra="ignore", frozen=True)

    role: Annotated[str, Strict(), Field(min_length=1), AfterValidator(check_text)]
    content: Annotated[Any, AfterValidator(_message_content)] = None
    tool_calls: Any = None
    tool_call_id: Any = None
    name: Any = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions`` (the prompt is the model's chat template over
    ``messages``)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    # Checked by tool_calls.py (400 naming the field).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Annotated[Any, AfterValidator(_optional_bool)] = None
    # logprobs: true reports each output token's logprob; top_logprobs adds that many of the
    # most likely alternatives and needs logprobs: true.
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # logprobs is validated first (field order); when it failed, its own error comes first.
        if value is not None and "logprobs" in info.data and info.data["logprobs"] is not True:
            raise _error("invalid_value", "needs logprobs: true")
        return value

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token for the engine, or None when no logprobs are asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        """The name and value of the output cap the client set (the newer name wins)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class LoadLoraAdapterRequest(_Body):
    """``POST /v1/load_lora_adapter``, vLLM's body."""

    lora_name: Name
    lora_path: Annotated[str, Strict(), AfterValidator(_adapter_path)]
    # vLLM's in-place reload; only a fresh load is supported.
    load_inplace: DefaultOnly = False
    # The mesh's own field (vLLM has none): keep the adapter in its GPU slot, never evicted,
    # until it is loaded again unpinned or unloaded (the control plane's placement loop sends
    # it for an AdapterInstance's pinnedShards).
    pinned: StrictBool = False


class UnloadLoraAdapterRequest(_Body):
    """``POST /v1/unload_lora_adapter``, vLLM's body."""

    lora_name: Name
    # vLLM accepts an integer id beside the name; names are what this server keys on.
    lora_int_id: StrictInt | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per output token."""

    tokens: list[str]
    token_logprobs: list[float]
    # Per token: the asked-for most likely alternatives and the sampled token, by text.
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class ChatChoice(BaseModel):
    index: int
    # role and content; an answer with tool calls: content may be null, and tool_calls.
    message: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


# ------------------------------------------------------------------------------------ errors
_TYPE_CODES = {
    "missing": "missing_field",
    "extra_forbidden": "unknown_field",
    "string_unicode": "invalid_unicode",
}


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        name = str(part) or '""'  # an unknown field named "" is still named
        if len(name) > MAX_QUOTED:  # a client's own key: a bounded prefix and its length
            name = quote(name)
        out += f"[{part}]" if isinstance(part, int) else (f".{name}" if out else name)
    return out


def request_error(exc: ValidationError) -> tuple[str, str, str]:
    """``(param, code, message)`` of a request body's first validation error."""
    error = exc.errors(include_url=False)[0]
    param = (_param(tuple(error["loc"])) or "body") + str((error.get("ctx") or {}).get("at", ""))
    kind = str(error["type"])
    code = _TYPE_CODES.get(kind)
    if code is None:
        if kind in {
            "invalid_type",
            "invalid_value",
            "invalid_unicode",
            "unsupported",
            "missing_field",
            "unknown_field",
        }:
            code = kind
        elif kind.endswith(("_type", "_parsing")) or kind in {"model_type", "dict_type"}:
            code = "invalid_type"
        else:
            code = "invalid_value"
    message = str(error["msg"])
    if code == "unknown_field":
        message = "is not a field this server knows" if kind == "extra_forbidden" else message
    elif code == "missing_field":
        message = "is required"
    elif message.startswith("Input should be"):
        message = "must be" + message[len("Input should be") :]
        got = error.get("input")
        if code == "invalid_type" and got is not None:
            message += f", got {type(got).__name__}"
    return param, code, f"{param}: {message}"
