"""The simulator's OpenAI-compatible HTTP API, as vLLM 0.33's API server answers it.

One :class:`ApiServer` fronts some ranks of a :class:`~sim.engine.DPGroup`: all of them (internal
LB) or its node's local ranks (hybrid LB, where ``X-data-parallel-rank`` is a local index).
aiohttp serves it because the local stack hosts dozens of API servers, side channels included,
in one event loop, and streaming costs it little per chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from baton.core.perf import api_server_ready
from baton.core.secrets import read_token
from baton.core.sim_tokenizer import (
    count_tokens,
    decode_token_ids,
    encode_token_ids,
    render_chat,
)
from sim.config import EngineConfig
from sim.engine import DPGroup
from sim.faults import FaultInjector
from sim.metrics import EngineCollector, engine_registry
from sim.nixl import NixlSide
from sim.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_message,
)
from sim.request import FinishReason, RequestFailed, RequestState, SimRequest, make_request

__all__ = ["ApiServer"]

log = logging.getLogger("baton.sim.server")

MAX_BODY_BYTES = 64 * 1024 * 1024
_SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.Response(
        status=status, body=error_body(status, message, param), content_type="application/json"
    )


# vLLM's guarded path prefixes: /health, /metrics and /version stay open with --api-key.
_GUARDED = ("/v1", "/v2", "/inference", "/cohere")


def _authentication(tokens: tuple[str, ...]) -> Any:
    """vLLM's API-key check: a bearer token matching one of ``tokens`` on every guarded path,
    compared in constant time, else 401 ``{"error": "Unauthorized"}`` as vLLM answers it."""
    digests = [hashlib.sha256(token.encode()).digest() for token in tokens]

    @web.middleware
    async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "OPTIONS" and request.path.startswith(_GUARDED):
            scheme, _, param = request.headers.get("Authorization", "").partition(" ")
            presented = hashlib.sha256(param.encode()).digest()
            matched = False
            for digest in digests:
                matched |= hmac.compare_digest(presented, digest)
            if scheme.lower() != "bearer" or not matched:
                return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    return authenticate


class ApiServer:
    """HTTP front of the ranks ``local_ranks`` of ``group``."""

    def __init__(
        self, config: EngineConfig, group: DPGroup, local_ranks: range, *, host: str, port: int
    ) -> None:
        self.config = config
        self.group = group
        self.local_ranks = local_ranks
        self.host = host
        self.port = port
        self.nixl = NixlSide(config, group, local_ranks)
        self.faults = (
            FaultInjector(
                group, self.nixl, local_ranks, read_token(config.fault_injection_token_file)
            )
            if config.fault_injection_token_file
            else None
        )
        self.registry = engine_registry(
            EngineCollector(config.served_model_names[0], group, local_ranks, self.nixl)
        )
        self._rng = random.Random(config.seed)
        # line-buffered, appended to: one whole line per write, whichever server writes it
        self._request_log = (
            open(config.request_log, "a", buffering=1)  # noqa: SIM115 (closed in stop)
            if config.request_log
            else None
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._tokenizer_free_at = 0.0  # simulated time its tokenizing thread is free from
        self._runner: web.AppRunner | None = None
        self.app = self._build_app()

    def _build_app(self) -> web.Application:
        middlewares = [_authentication(self.config.api_keys)] if self.config.api_keys else []
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/load", self._load)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        if self.faults is not None:
            app.router.add_post("/sim/faults", self.faults.handle)
        if self.config.dev_mode:
            app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handler_cancellation=True,
            # aiohttp reads 0 as "wait without bound"; vLLM's 0 aborts: a hundredth of a second
            shutdown_timeout=self.config.shutdown_timeout or 0.01,
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, backlog=1024).start()
        if self.config.kv_transfer.nixl:
            await self.nixl.start(self.host)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        await self.nixl.stop()
        if self._request_log is not None:
            self._request_log.close()

    # ---- small endpoints

    async def _models(self, _: web.Request) -> web.Response:
        created = int(time.time())
        data: list[dict[str, object]] = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.config.model,
                "parent": None,
                "max_model_len": self.config.max_model_len,
                "permission": [],
            }
            for name in self.config.served_model_names
        ]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, _: web.Request) -> web.Response:
        delay = self.faults.health_delay() if self.faults is not None else 0.0
        if delay:
            await asyncio.sleep(delay)
        return web.Response(status=503 if self.group.dead else 200)

    async def _reset_prefix_cache(self, _: web.Request) -> web.Response:
        """vLLM's development endpoint: every local rank's prefix cache forgotten, or none
        (``success`` false) while a request holds blocks."""
        caches = [self.group.ranks[r].cache for r in self.local_ranks]
        success = not any(cache.used_blocks for cache in caches)
        if success:
            for cache in caches:
                cache.reset()
            self.group.publish_kv_events()  # AllBlocksCleared now: an idle engine steps no more
        return web.json_response({"success": success})

    async def _load(self, _: web.Request) -> web.Response:
        load = sum(self.group.ranks[r].num_requests for r in self.local_ranks)
        return web.json_response({"server_load": load})

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "0.33.0+baton.sim"})

    # ---- generation

    async def _completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, chat=False)

    async def _chat_completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, chat=True)

    async def _generate(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        injected = self.faults.take_failure() if self.faults is not None else None
        if injected is not None:
            return _error(injected, "injected failure (baton sim fault injection)")
        try:
            raw = await http.read()
            payload = orjson.loads(raw)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
        except orjson.JSONDecodeError as exc:
            return _error(400, f"malformed JSON body: {exc}")
        try:
            body = (ChatCompletionRequest if chat else CompletionRequest).model_validate(payload)
        except ValidationError as exc:
            return _error(400, *validation_message(exc))
        try:
            request, tokenized = self._build_request(http, body, chat)
        except RequestFailed as exc:
            return _error(exc.status, exc.message)
        await self._before_queue(request, tokenized=tokenized)
        try:
            dp_rank = self._choose_rank(http)
            if request.remote_prefill is not None:
                self._reserve_remote(request, dp_rank)
            self.group.submit(request, dp_rank)
        except RequestFailed as exc:
            return _error(exc.status, exc.message)
        if request.state is RequestState.WAITING_FOR_REMOTE_KVS:
            self._spawn(self.nixl.pull(request))
        model = body.model or self.config.served_model_names[0]
        try:
            if body.stream:
                return await self._stream(http, request, body, model, chat)
            return await self._complete(request, body, model, chat)
        except ConnectionResetError:
            # The client left while a chunk was being written: its request is aborted below,
            # as when aiohttp cancels the handler, and aiohttp drops this unsendable answer.
            log.debug("client of %s went away mid-stream", request.external_id)
            return web.Response()
        finally:
            if not request.finished:
                self._abort(request)
            elif self._request_log is not None and request.failure is None:
                self._log_finished(request)

    async def _before_queue(self, request: SimRequest, *, tokenized: bool) -> None:
        """The API server's time between the request's arrival and its engine core's queue
        (the profile's ``frontend``): a text prompt waits for the one tokenizing thread."""
        now = self.group.clock.now()
        ready, self._tokenizer_free_at = api_server_ready(
            self.config.profile.frontend,
            now,
            self._tokenizer_free_at,
            request.prompt_tokens if tokenized else None,
        )
        if ready > now:
            await self.group.sim_clock.sleep(ready - now)

    def _log_finished(self, request: SimRequest) -> None:
        """One line of the request log: where the request ran, when (simulated seconds), and
        what the rank's prefix cache held for it. ``prompt`` is the BLAKE2b-128 of the prompt's
        bytes, which a client computes from what it sent (no request id survives every router)."""
        assert self._request_log is not None
        line = {
            "server": f"{self.host}:{self.port}",
            "dp_rank": request.dp_rank,
            "request_id": request.external_id,
            "arrival": request.arrival,
            "scheduled": request.scheduled_at,  # when its prefix was looked up in the cache
            "first_token": request.first_token_at,
            "prompt_tokens": request.prompt_tokens,
            "cached_tokens": request.cached_tokens,
            "external_tokens": request.external_tokens,
            "remote_decode": request.do_remote_decode,
            "prompt": hashlib.blake2b(request.prompt, digest_size=16).hexdigest(),
        }
        self._request_log.write(orjson.dumps(line).decode() + "\n")

    def _build_request(
        self, http: web.Request, body: CompletionRequest | ChatCompletionRequest, chat: bool
    ) -> tuple[SimRequest, bool]:
        """The request, and whether its API server tokenizes its prompt (text, not ids)."""
        if body.model is not None and body.model not in self.config.served_model_names:
            raise RequestFailed(404, f"The model `{body.model}` does not exist.")
        if body.n != 1:
            raise RequestFailed(
                400,
                f"n={body.n} is not supported by baton sim; send n=1 "
                "and repeat the request for more choices",
            )
        if chat:
            assert isinstance(body, ChatCompletionRequest)
            prompt, tokenized = render_chat(body.messages, body.add_generation_prompt), True
            requested = body.requested_max_tokens
        else:
            assert isinstance(body, CompletionRequest)
            prompt, tokenized = self._completion_prompt(body.prompt)
            requested = body.max_tokens
        prompt_tokens = count_tokens(prompt)
        limit = self.config.max_model_len
        if prompt_tokens >= limit:
            raise RequestFailed(
                400,
                f"This model's maximum context length is {limit} tokens. "
                f"However, your request has {prompt_tokens} input tokens. "
                "Please reduce the length of the input messages.",
            )
        max_tokens = requested if requested is not None else limit - prompt_tokens
        if prompt_tokens + max_tokens > limit:
            raise RequestFailed(
                400,
                f"'max_tokens' is too large: {max_tokens}. This model's "
                f"maximum context length is {limit} tokens and your request "
                f"has {prompt_tokens} input tokens "
                f"({max_tokens} > {limit} - {prompt_tokens}).",
            )
        if body.seed is not None:
            seed = body.seed
        elif body.temperature == 0:
            seed = 0  # greedy decoding is deterministic
        else:
            seed = self._rng.getrandbits(63)
        params = body.kv_transfer_params or {}
        nixl = self.config.kv_transfer.nixl
        request = make_request(
            prompt,
            external_id=http.headers.get("X-Request-Id") or uuid.uuid4().hex,
            max_tokens=max_tokens,
            block_size=self.config.block_size,
            arrival=self.group.clock.now(),
            seed=seed,
            ignore_eos=body.ignore_eos,
            mean_output_tokens=self.config.profile.mean_output_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop_strings(),
            do_remote_decode=bool(params.get("do_remote_decode")) and nixl,
            remote_prefill=params if params.get("do_remote_prefill") and nixl else None,
        )
        return request, tokenized

    def _completion_prompt(
        self, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> tuple[bytes, bool]:
        """The prompt's bytes, and whether the API server tokenizes it (text, not ids)."""
        if isinstance(prompt, str):
            return prompt.encode(), True
        ids = [item for item in prompt if isinstance(item, int)]
        if prompt and len(ids) == len(prompt):
            if any(not 0 <= item < 2**32 for item in ids):
                raise RequestFailed(400, "prompt token ids must be in [0, 2**32)")
            return encode_token_ids(ids), False
        if len(prompt) == 1 and isinstance(prompt[0], str | list):
            return self._completion_prompt(prompt[0])
        raise RequestFailed(
            400, "batched prompts are not supported by baton sim; send one prompt per request"
        )

    def _choose_rank(self, http: web.Request) -> int:
        header = http.headers.get("X-data-parallel-rank")
        if header is not None:
            try:
                index = int(header)
            except ValueError:
                index = None  # vLLM ignores a header that is not an integer
            if index is not None:
                # Under hybrid LB the index is local to this server's ranks, as in vLLM.
                count = len(self.local_ranks)
                if not 0 <= index < count:
                    raise RequestFailed(
                        400, f"data_parallel_rank {index} is out of range [0, {count})."
                    )
                return self.local_ranks[index]
        return self.group.least_loaded_rank(self.local_ranks)

    def _reserve_remote(self, request: SimRequest, dp_rank: int) -> None:
        """Blocks for a KV pull: local prefix hits stay, the rest come from the prefill engine."""
        cache = self.group.ranks[dp_rank].cache
        allocation = cache.allocate(request.hashes, request.prompt_tokens)
        if allocation is None:  # no room to receive: prefill locally once room frees up
            request.remote_prefill = None
            return
        request.allocation = allocation
        request.cached_tokens = allocation.cached_tokens
        request.state = RequestState.WAITING_FOR_REMOTE_KVS

    def _spawn(self, coroutine: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _abort(self, request: SimRequest) -> None:
        pulling = request.state is RequestState.WAITING_FOR_REMOTE_KVS
        self.group.finish(request, FinishReason.ABORT)
        if pulling:
            self._spawn(self.nixl.notify_free(request))

    # ---- responses

    def _usage(self, request: SimRequest) -> dict[str, object]:
        return {
            "prompt_tokens": request.prompt_tokens,
            "total_tokens": request.prompt_tokens + request.output_tokens,
            "completion_tokens": request.output_tokens,
            "prompt_tokens_details": {"cached_tokens": request.cached_tokens},
        }

    def _kv_params(self, request: SimRequest) -> dict[str, object] | None:
        return self.nixl.transfer_params(request) if request.kv_block_ids else None

    async def _complete(
        self,
        request: SimRequest,
        body: CompletionRequest | ChatCompletionRequest,
        model: str,
        chat: bool,
    ) -> web.Response:
        while not request.finished:
            await request.wait_output()
        if request.failure is not None:
            return _error(request.failure.status, request.failure.message)
        prefix = "chatcmpl" if chat else "cmpl"
        finish = request.finish_reason.value if request.finish_reason else None
        if chat:
            choice: dict[str, object] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": request.text,
                    "reasoning_content": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": request.stop_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": request.text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": request.stop_reason,
                "prompt_logprobs": None,
            }
            if isinstance(body, CompletionRequest) and body.return_token_ids:
                choice["token_ids"] = _generated_ids(request.text)
        response = {
            "id": f"{prefix}-{request.external_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": self._usage(request),
            "prompt_logprobs": None,
            "kv_transfer_params": self._kv_params(request),
        }
        return web.Response(
            body=orjson.dumps(response),
            content_type="application/json",
            headers={"X-Request-Id": request.external_id},
        )

    async def _stream(
        self,
        http: web.Request,
        request: SimRequest,
        body: CompletionRequest | ChatCompletionRequest,
        model: str,
        chat: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={**_SSE, "X-Request-Id": request.external_id})
        await response.prepare(http)
        created = int(time.time())
        object_name = "chat.completion.chunk" if chat else "text_completion"
        head = orjson.dumps(
            {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{request.external_id}",
                "object": object_name,
                "created": created,
                "model": model,
            }
        )[:-1]
        if chat:
            await response.write(
                b"data: " + head + b',"choices":[{"index":0,"delta":'
                b'{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}]}\n\n'
            )
        while True:
            await request.wait_output()
            if request.failure is not None:
                await response.write(
                    b"data: "
                    + error_body(request.failure.status, request.failure.message)
                    + b"\n\ndata: [DONE]\n\n"
                )
                return response
            text = request.take_text()
            done = request.finished
            if not text and not done:
                continue
            finish = (
                orjson.dumps(request.finish_reason.value)
                if done and request.finish_reason
                else b"null"
            )
            stop_reason = orjson.dumps(request.stop_reason) if done else b"null"
            if chat:
                piece = b'"delta":{"content":' + orjson.dumps(text) + b"}"
            else:
                piece = b'"text":' + orjson.dumps(text)
                if isinstance(body, CompletionRequest) and body.return_token_ids:
                    piece += b',"token_ids":' + orjson.dumps(_generated_ids(text))
            frame = (
                b"data: " + head + b',"choices":[{"index":0,' + piece + b',"logprobs":null,'
                b'"finish_reason":' + finish + b',"stop_reason":' + stop_reason + b"}]"
            )
            if done and request.kv_block_ids:
                frame += b',"kv_transfer_params":' + orjson.dumps(self._kv_params(request))
            await response.write(frame + b"}\n\n")
            if done:
                break
        options = body.stream_options
        if options is not None and options.include_usage:
            await response.write(
                b"data: "
                + head
                + b',"choices":[],"usage":'
                + orjson.dumps(self._usage(request))
                + b"}\n\n"
            )
        await response.write(b"data: [DONE]\n\n")
        return response


def _generated_ids(text: str) -> list[int]:
    """The ids of generated text: each generated word is one 4-byte token."""
    return decode_token_ids(text.encode())
