"""A generation request's inputs, built off the event loop where they are heavy: its output
constraint (a grammar, compiled), its tool plan, and its prompt's token ids.

Prompts up to ``_TOKENIZE_INLINE_CHARS`` characters are tokenised on the event loop (under
1 ms with the Rust tokenizer); longer ones, chat templates over them and grammars go to the
tokenizer threads, so a 4 MB prompt does not stall other requests. A request for an adapter
that ships its own tokenizer (``Engine.adapter_text``, ``adapter_text.py``) is tokenised, and
its grammar compiled, with that tokenizer.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from adaptermesh.worker.api import ChatCompletionRequest, CompletionRequest
from adaptermesh.worker.grammar import GrammarError, GrammarSpec
from adaptermesh.worker.http_errors import adapter_error, invalid_field
from adaptermesh.worker.request_translation import (
    ParsedGeneration,
    chat_messages,
    chat_template_missing_error,
    fill_in_middle_missing_error,
    refuse_untokenised,
)
from adaptermesh.worker.structured_request import bad_field, grammar_error, grammar_spec
from adaptermesh.worker.tool_calls import detect_tool_parser, template_messages, tool_plan
from adaptermesh.worker.types import AdapterNotFoundError, EngineProtocol

__all__ = ["GenerationInputs"]

_TOKENIZE_INLINE_CHARS = 16 << 10
_Result = TypeVar("_Result")


class GenerationInputs:
    """The inputs of the requests of one engine; ``tool_call_parser`` is the format chat tool
    calls are parsed from ("auto" picks by the tokenizer's marker tokens, then the model)."""

    def __init__(self, engine: EngineProtocol, tool_call_parser: str) -> None:
        self.engine = engine
        self._tool_call_parser = tool_call_parser
        self._tool_format: str | None = None
        # Two threads keep one 4 MB prompt from holding up the next long one.
        self._cpu = ThreadPoolExecutor(2, thread_name_prefix="worker-tokenize")

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)

    def output_constraints(self, parsed: ParsedGeneration) -> tuple[GrammarSpec | None, Any]:
        """The request's output constraint (``response_format``, ``structured_outputs``,
        ``guided_*``, or what ``tool_choice`` forces) and, for a chat with tools, its
        ``ToolPlan``; 400 naming the field when malformed."""
        spec = grammar_spec(parsed)
        plan = None
        if isinstance(parsed, ChatCompletionRequest):
            plan = tool_plan(
                parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls, self._tool_parser()
            )
        forced = None if plan is None else plan.grammar_spec()
        if forced is not None:
            if spec is not None:
                raise bad_field(
                    spec.param.split(".")[0],
                    "cannot be combined with tool_choice 'required' or a named function",
                )
            spec = forced
        return spec, plan

    def _tool_parser(self) -> str:
        if self._tool_format is None:
            chosen = self._tool_call_parser
            if chosen == "auto":
                model_config = getattr(self.engine, "model_config", None)
                tokenizer = getattr(self.engine, "tokenizer", None)
                vocab = tokenizer.get_vocab() if tokenizer is not None else {}
                chosen = detect_tool_parser(str(getattr(model_config, "arch", "")), vocab)
            self._tool_format = chosen
        return self._tool_format

    async def adapter_text(self, adapter: str | None) -> Any:
        """The tokenizer helper of requests for ``adapter`` when the adapter ships its own
        (None: the engine's tokenizer serves them)."""
        adapter_text = getattr(self.engine, "adapter_text", None)
        if adapter is None or adapter_text is None:
            return None
        try:
            return await adapter_text(adapter)
        except AdapterNotFoundError as exc:  # its tokenizer files do not load: 400
            raise adapter_error(exc, "model") from None

    async def compile_grammar(self, spec: GrammarSpec, adapter: str | None = None) -> Any:
        """``spec`` compiled by the engine on the tokenizer threads (a schema can take tens of
        milliseconds), with the tokenizer of requests for ``adapter``; 400 naming the field
        when it does not compile."""
        compile_grammar = getattr(self.engine, "compile_grammar", None)
        if compile_grammar is None:
            raise invalid_field(
                spec.param, "this engine does not serve constrained outputs", code="unsupported"
            )
        if await self.adapter_text(adapter) is not None:
            compile_grammar = functools.partial(compile_grammar, adapter=adapter)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._cpu, compile_grammar, spec
            )
        except GrammarError as exc:
            raise grammar_error(exc) from None

    async def prompt_token_ids(
        self, parsed: ParsedGeneration, plan: Any = None, adapter: str | None = None
    ) -> list[int]:
        """The prompt's token ids: a completion's ids as sent or its text tokenised, a chat's
        messages (with its tools) through the model's chat template, with the tokenizer of
        requests for ``adapter``. A text that cannot fit the context is refused before it is
        tokenised."""
        text: Any = await self.adapter_text(adapter) or self.engine
        max_model_len = self.engine.max_model_len
        max_token_chars = getattr(text, "max_token_chars", 0)
        if isinstance(parsed, CompletionRequest):
            prompt = parsed.prompt
            if parsed.suffix is not None:
                return await self._fill_in_middle_ids(prompt, parsed.suffix, text)
            if not isinstance(prompt, str):
                return list(prompt)
            refuse_untokenised(len(prompt), max_model_len, max_token_chars, "prompt")
            return list(await self._off_loop(len(prompt), text.tokenize, prompt))
        messages = chat_messages(parsed)
        chars = sum(len(message["content"] or "") for message in messages)
        refuse_untokenised(chars, max_model_len, max_token_chars, "messages")
        if plan is not None or any(
            m.tool_calls is not None or m.role == "tool" for m in parsed.messages
        ):
            rich = template_messages(parsed.messages)
            tools = None if plan is None else plan.tools
            # Tool definitions and calls count toward the template's text too.
            chars += len(json.dumps(tools)) + sum(
                len(json.dumps(m.get("tool_calls", ""))) for m in rich
            )
            apply: Any = functools.partial(cast(Any, text).apply_chat_template, rich, tools=tools)
            ids = await self._off_loop(chars, apply)
        else:
            ids = await self._off_loop(chars, text.apply_chat_template, messages)
        if ids is None:
            raise chat_template_missing_error()
        return list(ids)

    async def _fill_in_middle_ids(
        self, prompt: str | list[int], suffix: str, text: Any
    ) -> list[int]:
        """A completion's fill-in-the-middle prompt (``suffix``) through ``text`` (the engine
        or an adapter's tokenizer helper): 400 naming ``suffix`` on a model without FIM tokens
        (an engine without ``fill_in_middle`` has none)."""
        fill_in_middle = getattr(text, "fill_in_middle", None)
        if fill_in_middle is None:
            raise fill_in_middle_missing_error()
        max_model_len = self.engine.max_model_len
        max_token_chars = getattr(text, "max_token_chars", 0)
        chars = (len(prompt) if isinstance(prompt, str) else 0) + len(suffix)
        refuse_untokenised(chars, max_model_len, max_token_chars, "prompt")
        ids = await self._off_loop(chars, fill_in_middle, prompt, suffix)
        if ids is None:
            raise fill_in_middle_missing_error()
        return list(ids)

    async def _off_loop(self, size: int, function: Callable[..., _Result], *args: Any) -> _Result:
        """``function(*args)`` inline when ``size`` is small, else on the tokenizer threads."""
        if size <= _TOKENIZE_INLINE_CHARS:
            return function(*args)
        return await asyncio.get_running_loop().run_in_executor(self._cpu, function, *args)
