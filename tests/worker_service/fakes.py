"""A deterministic in-memory engine implementing ``EngineProtocol`` for HTTP-layer tests.

Token ``i`` of a request is a pure function of the prompt, the adapter and ``i``, so tests can
compute the expected text without the service. The engine runs at most ``max_batch`` requests
at once (the rest wait in its own queue) and sleeps ``token_delay`` seconds per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import cast

from adaptermesh.worker.engine import Engine
from adaptermesh.worker.types import (
    AdapterInfo,
    AdapterNotFoundError,
    AdapterResolution,
    EngineError,
    EngineOverloadedError,
    EngineStats,
    GenerationRequest,
    InvalidRequestError,
    TokenEvent,
)

VOCAB = 1000


def word_id(word: str) -> int:
    return zlib.crc32(word.encode()) % VOCAB


def expected_ids(prompt_ids: list[int] | tuple[int, ...], adapter: str | None, n: int) -> list[int]:
    salt = 0 if adapter is None else zlib.crc32(adapter.encode())
    base = sum(prompt_ids) * 31 + salt
    return [(base + 7 * i * i + 13 * i) % VOCAB for i in range(n)]


def expected_text(prompt_ids: list[int] | tuple[int, ...], adapter: str | None, n: int) -> str:
    return "".join(f" w{t}" for t in expected_ids(prompt_ids, adapter, n))


class FakeStream:
    def __init__(self, engine: FakeEngine, request: GenerationRequest) -> None:
        self.engine = engine
        self.request = request
        self.cancelled = False
        # Like the scheduler's: on the first event (the engine's first lookup to its lease).
        self.resolution: AdapterResolution | None = None
        self._wake = asyncio.Event()

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.engine.cancelled.append(self.request.request_id)
        self._wake.set()

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._run()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    async def _run(self) -> AsyncIterator[TokenEvent]:
        eng = self.engine
        req = self.request
        if eng.fail_in_stream is not None:
            raise eng.fail_in_stream
        looked_up = time.monotonic()
        if req.adapter is not None and req.adapter not in eng.adapters:
            if req.adapter not in eng.on_disk:
                raise AdapterNotFoundError(req.adapter)
            eng.adapters[req.adapter] = AdapterInfo(req.adapter, f"/root/{req.adapter}", 8, True)
            eng.misses += 1
            eng.load_latencies.append(0.003)
            self.resolution = AdapterResolution("disk", looked_up, time.monotonic(), 0.003, 1)
        elif req.adapter is not None:
            eng.hits += 1
            self.resolution = AdapterResolution("gpu", looked_up, time.monotonic(), 0.0, 1)
        eng.waiting.append(req)
        try:
            async with eng.slots:
                eng.waiting.remove(req)
                eng.running.append(req)
                eng.admitted.append(req.request_id)
                try:
                    async for event in self._generate():
                        yield event
                finally:
                    eng.running.remove(req)
        finally:
            if req in eng.waiting:
                eng.waiting.remove(req)

    async def _generate(self) -> AsyncIterator[TokenEvent]:
        eng = self.engine
        req = self.request
        ids = expected_ids(req.prompt_token_ids, req.adapter, req.sampling.max_tokens)
        text = ""
        n_prompt = len(req.prompt_token_ids)
        for i, token in enumerate(ids):
            if eng.token_delay:
                await self._sleep(eng.token_delay)
            else:
                await asyncio.sleep(0)
            if self.cancelled:
                yield TokenEvent(None, "", "cancelled", n_prompt, i)
                return
            if req.deadline is not None and time.monotonic() > req.deadline:
                yield TokenEvent(None, "", "cancelled", n_prompt, i)
                return
            if eng.fail_after is not None and i == eng.fail_after:
                yield TokenEvent(None, "", "error", n_prompt, i)
                return
            piece = f" w{token}"
            text += piece
            eng.generated += 1
            done = i + 1 == len(ids)
            reason = None
            if any(s in text for s in req.sampling.stop):
                reason = "stop"
            elif done:
                reason = "length"
            resolution, self.resolution = self.resolution, None
            yield TokenEvent(token, piece, reason, n_prompt, i + 1, (), resolution)
            if reason is not None:
                return


class FakeEngine:
    model_name = "tiny-base"
    on_gpu = False

    def __init__(
        self,
        *,
        max_batch: int = 8,
        token_delay: float = 0.0,
        max_model_len: int = 128,
        chat: bool = True,
    ) -> None:
        self.max_model_len = max_model_len
        self.model_config = SimpleNamespace(vocab_size=VOCAB)  # what Engine._validate reads
        self.token_delay = token_delay
        self.chat = chat
        self.slots = asyncio.Semaphore(max_batch)
        self.max_batch = max_batch
        self.adapters: dict[str, AdapterInfo] = {}
        self.on_disk: set[str] = {"alpha", "beta", "gamma"}
        self.waiting: list[GenerationRequest] = []
        self.running: list[GenerationRequest] = []
        self.submitted: list[GenerationRequest] = []
        self.admitted: list[str] = []
        self.cancelled: list[str] = []
        self.hits = self.misses = self.evictions = 0
        self.generated = 0
        self.load_latencies: list[float] = []
        self.fail_on_submit: Exception | None = None
        self.fail_on_load: Exception | None = None
        self.fail_in_stream: Exception | None = None
        self.fail_after: int | None = None
        self.shut_down = False
        self.knows_adapter_calls = 0
        self.list_adapters_calls = 0

    def submit(self, request: GenerationRequest) -> FakeStream:
        if self.fail_on_submit is not None:
            raise self.fail_on_submit
        if self.shut_down:
            raise EngineError("engine is shut down")
        # The engine's own request checks (fields, limits, messages), over this vocabulary
        # and max_model_len: tests/worker_service/test_fake_engine_contract.py holds the two
        # to the same answers.
        Engine._validate(cast(Engine, self), request)
        self.submitted.append(request)
        return FakeStream(self, request)

    def tokenize(self, text: str) -> list[int]:
        return [word_id(w) for w in text.split()] or [0]

    def detokenize(self, token_ids: list[int]) -> str:
        return "".join(f" w{t}" for t in token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int] | None:
        if not self.chat:
            return None
        return self.tokenize(" ".join(f"{m['role']}: {m['content']}" for m in messages))

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> AdapterInfo:
        if self.fail_on_load is not None:
            raise self.fail_on_load
        if ".." in path:
            raise InvalidRequestError("path", "must stay inside the adapter root")
        if not path.startswith("ok"):
            raise AdapterNotFoundError(name, f"no adapter at {path}")
        await asyncio.sleep(0.001)
        info = AdapterInfo(name, path, 8, False, pinned)
        self.adapters[name] = info
        self.load_latencies.append(0.001)
        return info

    async def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterNotFoundError(name)
        del self.adapters[name]
        self.on_disk.discard(name)

    def list_adapters(self) -> list[AdapterInfo]:
        self.list_adapters_calls += 1
        return list(self.adapters.values())

    def knows_adapter(self, name: str) -> bool:
        self.knows_adapter_calls += 1
        return name in self.adapters

    async def locate_adapter(self, name: str) -> str | None:
        if name in self.adapters:
            return "resident"
        return "root" if name in self.on_disk else None

    def stats(self) -> EngineStats:
        latencies, self.load_latencies = tuple(self.load_latencies), []
        return EngineStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            kv_cache_usage=len(self.running) / self.max_batch,
            gpu_slots_used=len(self.adapters),
            gpu_slots_total=4,
            adapter_hits=self.hits,
            adapter_misses=self.misses,
            adapter_evictions=self.evictions,
            free_gpu_bytes=0,
            generated_tokens=self.generated,
            new_load_latencies=latencies,
            running_adapters=tuple(r.adapter for r in self.running if r.adapter),
            waiting_adapters=tuple(r.adapter for r in self.waiting if r.adapter),
            max_loras=4,
        )

    async def shutdown(self) -> None:
        self.shut_down = True


__all__ = ["EngineOverloadedError", "FakeEngine", "expected_ids", "expected_text", "word_id"]
