"""From an OpenAI request body to the engine's ``GenerationRequest``: validation, the model and
adapter a request names, its output-token budget, deadline and tenant, and the sampling
settings. Everything here is pure; tokenisation, which needs the engine, is the service's.
Every refusal is an ``ApiError`` naming the field (``param``)."""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from adaptermesh.assignment_rules import VERSION_SEPARATOR, RuleError, check_version, served_name
from adaptermesh.worker.api import ChatCompletionRequest, CompletionRequest, request_error
from adaptermesh.worker.generation_job import GenerationJob, GenerationKind
from adaptermesh.worker.http_errors import ApiError, adapter_error, invalid_field
from adaptermesh.worker.merge_spec import MERGE_FIELD, MergeSpecError
from adaptermesh.worker.types import AdapterNotFoundError, GenerationRequest, SamplingParams

__all__ = [
    "ADAPTER_HEADER",
    "REQUEST_TIMEOUT_HEADER",
    "SHARD_HEADER",
    "VERSION_HEADER",
    "ParsedGeneration",
    "chat_messages",
    "chat_template_missing_error",
    "checked_max_tokens",
    "context_length_error",
    "fill_in_middle_missing_error",
    "generation_job",
    "generation_request",
    "merged_adapter",
    "parse_body",
    "parse_generation_body",
    "refuse_untokenised",
    "request_timeout",
    "resolve_model",
    "sampling_params",
    "tenant_of",
]

# The adapter header the mesh's Envoy sets (mesh/snapshot.py BuildOptions.adapter_header); the
# worker sits beside the mesh, not above it, so the name is repeated here.
ADAPTER_HEADER = "x-adapter-id"
# The shard whose Envoy sent the request (agent/extproc.py's header), for span attributes.
SHARD_HEADER = "x-adaptermesh-shard"
# The adapter version the mesh chose (a rollout's split, a routing rule): agent/extproc.py sets it.
VERSION_HEADER = "x-adapter-version"
# A client's own deadline for its request, in seconds.
REQUEST_TIMEOUT_HEADER = "x-request-timeout"
_TENANT_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:@/+-]{1,64}$")

ParsedGeneration = CompletionRequest | ChatCompletionRequest
_Body = TypeVar("_Body", bound=BaseModel)


def tenant_of(request: web.BaseRequest) -> str:
    """The tenant a request belongs to: its API key, else ``x-tenant-id``, else its address.

    API keys are hashed so that metrics labels and logs never carry a secret.
    """
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        return "key-" + hashlib.sha256(token.encode()).hexdigest()[:16]
    header = request.headers.get("x-tenant-id", "").strip()
    if header:
        if _TENANT_ID_PATTERN.match(header):
            return "id-" + header
        # An odd header value still names a tenant, but never lands raw in a metrics label.
        return "id-sha-" + hashlib.sha256(header.encode()).hexdigest()[:16]
    return "ip-" + (request.remote or "unknown")


def parse_body(model: type[_Body], body: dict[str, Any]) -> _Body:
    """``body`` as ``model``; the first invalid field is a 400 naming it."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        param, code, message = request_error(exc)
        raise ApiError(400, message, param=param, code=code) from None


def parse_generation_body(kind: GenerationKind, body: dict[str, Any]) -> ParsedGeneration:
    """``body`` as the request model of endpoint ``kind``."""
    if kind == "completion":
        return parse_body(CompletionRequest, body)
    return parse_body(ChatCompletionRequest, body)


def resolve_model(
    body_model: str | None, headers: Mapping[str, str], base_model: str
) -> tuple[str, str | None]:
    """``(model, adapter)`` a request names: the body's model, else the adapter the edge named
    in ``x-adapter-id``, else the base model; the adapter is None for the base model.

    A version the mesh chose (``x-adapter-version``: a rollout's split or a routing rule)
    names the adapter's versioned name (docs/rollout.md) unless the model already has one.
    """
    # A body without a model, sent to an AdapterInstance's path: the edge names the
    # adapter in the header (mesh/edge.py). The body's own model always wins.
    model = body_model or headers.get(ADAPTER_HEADER, "").strip() or base_model
    version = headers.get(VERSION_HEADER)
    if version and model != base_model and VERSION_SEPARATOR not in model:
        try:
            check_version(version, VERSION_HEADER, allow_empty=False)
        except RuleError as exc:
            raise invalid_field(VERSION_HEADER, exc.message, code="invalid_header") from None
        model = served_name(model, version)
    return model, None if model == base_model else model


async def merged_adapter(
    parsed: ParsedGeneration, model: str, adapter: str | None, engine: Any
) -> tuple[str, str | None]:
    """``(model, adapter)`` of a request with ``merged_adapters``: the base model (what the
    response echoes) and the merged adapter's name (built on its first request,
    ``AdapterManager.merged``); unchanged without it. Its ``model`` must name the base model;
    an unknown part is a 404 like an unknown model, every other bad value a 400 naming the
    sub-field."""
    spec = parsed.merged_adapters
    if spec is None:
        return model, adapter
    if adapter is not None:
        raise invalid_field(
            "model",
            f"must name the base model when {MERGE_FIELD} is given (the merge names its parts)",
        )
    manager = getattr(engine, "adapters", None)
    if manager is None or not hasattr(manager, "merged"):
        raise invalid_field(MERGE_FIELD, "this worker does not merge adapters", code="unsupported")
    try:
        name = await manager.merged(spec, model)
    except MergeSpecError as exc:
        raise invalid_field(exc.param, exc.message) from None
    except AdapterNotFoundError as exc:
        raise adapter_error(exc, f"{MERGE_FIELD}.ids") from None
    return model, name


def context_length_error(param: str, detail: str, max_model_len: int) -> ApiError:
    """400 ``context_length_exceeded`` naming ``param``, worded as OpenAI's (``This model's
    maximum context length is N tokens``), so clients that truncate and retry on it work."""
    return ApiError(
        400,
        f"{param}: this model's maximum context length is {max_model_len} tokens. However, "
        f"{detail}",
        param=param,
        code="context_length_exceeded",
    )


def refuse_untokenised(chars: int, max_model_len: int, max_token_chars: object, param: str) -> None:
    """400 ``context_length_exceeded`` for a text too long for the context whatever its
    tokens: no token covers more than ``max_token_chars`` characters (the engine's, when it
    says), so nothing is tokenised (a multi-megabyte prompt costs no tokenizer time and never
    stalls the loop)."""
    per = max_token_chars
    if isinstance(per, int) and per > 0 and chars > max_model_len * per:
        raise context_length_error(
            param,
            f"{chars} characters cannot fit it (no token of this model covers more than "
            f"{per} characters)",
            max_model_len,
        )


def chat_messages(parsed: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages the chat template is applied to."""
    return [{"role": m.role, "content": m.content} for m in parsed.messages]


def fill_in_middle_missing_error() -> ApiError:
    return ApiError(
        400,
        "suffix: this model has no fill-in-the-middle tokens, so it cannot complete between a "
        "prompt and a suffix; send the prompt alone",
        param="suffix",
        code="unsupported",
    )


def chat_template_missing_error() -> ApiError:
    return ApiError(
        400,
        "messages: this model's tokenizer has no chat template; use /v1/completions",
        param="messages",
        code="chat_template_missing",
    )


def checked_max_tokens(
    parsed: ParsedGeneration, prompt_length: int, max_model_len: int, default_max_tokens: int
) -> int:
    """The output-token cap of a request whose prompt has ``prompt_length`` tokens.

    400 ``context_length_exceeded`` when the prompt leaves no room in the context, or the cap
    the client set is beyond the room left (naming the field it set). Without a cap, a
    completion gets ``default_max_tokens`` (at most the room left) and a chat the whole room;
    a cap below 1 is refused naming the field.
    """
    is_completion = isinstance(parsed, CompletionRequest)
    if prompt_length >= max_model_len:
        raise context_length_error(
            "prompt" if is_completion else "messages",
            f"the prompt has {prompt_length} tokens, so a prompt may have at most "
            f"{max_model_len - 1}",
            max_model_len,
        )
    if isinstance(parsed, CompletionRequest):
        max_tokens_name, max_tokens = "max_tokens", parsed.max_tokens
    else:
        max_tokens_name, max_tokens = parsed.max_tokens_field
    room = max_model_len - prompt_length
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room) if is_completion else room
    if max_tokens < 1:
        raise invalid_field(max_tokens_name, f"must be at least 1, got {max_tokens}")
    if max_tokens > room:
        raise context_length_error(
            max_tokens_name,
            f"you requested {prompt_length + max_tokens} tokens ({prompt_length} in the "
            f"prompt, {max_tokens} in {max_tokens_name}), so at most {room} tokens can be "
            "generated",
            max_model_len,
        )
    return max_tokens


def request_timeout(header: str | None, default_s: float, max_s: float) -> float:
    """Seconds a request may take: ``x-request-timeout`` (a positive number, capped at
    ``max_s``) when sent, else ``default_s``."""
    if header is None:
        return default_s
    try:
        timeout = float(header)
    except ValueError:
        timeout = math.nan
    if not math.isfinite(timeout) or timeout <= 0:
        raise invalid_field(
            REQUEST_TIMEOUT_HEADER, "must be a positive number of seconds", code="invalid_header"
        )
    return min(timeout, max_s)


# The body's sampling fields that SamplingParams takes as they are, under the same name (a
# new sampling parameter is one more name here); the others are converted below.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "typical_p",
    "logit_bias",
)


def sampling_params(parsed: ParsedGeneration, max_tokens: int) -> SamplingParams:
    """The engine's sampling settings of a validated body (top_k -1, vLLM's "off", is 0)."""
    return SamplingParams(
        max_tokens=max_tokens,
        top_k=max(parsed.top_k, 0),
        logprobs=parsed.logprobs_k,
        **{name: getattr(parsed, name) for name in _SAMPLING_FIELDS},
    )


def generation_job(
    parsed: ParsedGeneration,
    *,
    model: str,
    adapter: str | None,
    prompt_ids: list[int],
    max_tokens: int,
    tenant: str,
    arrived: float,
    timeout_s: float,
    trace_fields: dict[str, Any] | None = None,
    grammar: Any = None,
    tool_plan: Any = None,
    echo: str | None = None,
) -> GenerationJob:
    """The job of a validated body; its deadline is ``arrived + timeout_s`` (monotonic);
    ``echo``: the prompt's text for a completion that asked for it."""
    kind: GenerationKind = "completion" if isinstance(parsed, CompletionRequest) else "chat"
    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    sampling = sampling_params(parsed, max_tokens)
    best_of = parsed.best_of if parsed.best_of is not None and parsed.best_of > parsed.n else 0
    # best_of ranks its candidates by cumulative logprob: the engine reports the sampled
    # tokens' logprobs even when the client asked for none.
    ranking = bool(best_of) and sampling.logprobs is None
    if ranking:
        sampling = replace(sampling, logprobs=0)
    return GenerationJob(
        kind=kind,
        model=model,
        adapter=adapter,
        prompt_ids=prompt_ids,
        sampling=sampling,
        n=parsed.n,
        best_of=best_of,
        ranking_logprobs=ranking,
        echo=echo,
        stream=parsed.stream,
        include_usage=parsed.include_usage,
        tenant=tenant,
        arrived=arrived,
        deadline=arrived + timeout_s,
        request_id=prefix + uuid.uuid4().hex,
        grammar=grammar,
        tool_plan=tool_plan,
        **(trace_fields or {}),
    )


def generation_request(job: GenerationJob, index: int) -> GenerationRequest:
    """The engine request of choice ``index``; choice i > 0 of a seeded request gets
    seed + i, so the choices differ and the whole answer is still reproducible."""
    sampling = job.sampling
    if index and sampling.seed is not None:
        sampling = replace(sampling, seed=sampling.seed + index)
    return GenerationRequest(
        request_id=job.request_id if job.candidates == 1 else f"{job.request_id}-{index}",
        prompt_token_ids=tuple(job.prompt_ids),
        adapter=job.adapter,
        sampling=sampling,
        deadline=job.deadline,
        grammar=job.grammar,
    )
