"""A prompt's token ids as the engine will see them, so that the gateway can key the blocks the
engine caches (``router/prefix.py``) and read the engine's KV events about them.

Two tokenizers, chosen by ``--tokenizer``:

- :class:`SimTokenizer` for ``baton sim`` engines: the simulator's chat template and its rule of
  4 bytes a token (``baton/core/sim_tokenizer.py``).
- :class:`HFTokenizer` for vLLM engines: the model's Hugging Face tokenizer files
  (``tokenizer.json``, with the chat template of ``chat_template.jinja`` or
  ``tokenizer_config.json``), read from a directory, never fetched. A chat is rendered as vLLM
  renders it through transformers (a sandboxed Jinja environment with ``trim_blocks`` and
  ``lstrip_blocks``, the special tokens as variables, text parts joined by newlines) and
  tokenized without special tokens added; a completion prompt with them added, as vLLM does by
  default.

Either returns the ids packed as 4 little-endian bytes each (:func:`token_block_keys` hashes
them as they are), or None for a prompt it cannot render as the engine would (a request that
asks to continue its final message, a template that raises): such a request is routed by its
affinity key alone. A rendering that differs from the engine's costs only cache matches.

A long prompt is tokenized in chunks (:class:`ChunkedEncoder`), cut where the tokenizer's
pre-tokenizer splits the text anyway, so that the chunks' tokens are the whole text's: the
chunks are encoded in parallel, and each chunk's tokens are kept under a hash of the text up to
its end, so that the prefix a prompt shares with an earlier one (a conversation's earlier turns,
an agent's instructions, a document) is not tokenized again (llm-d's KV-cache manager keeps a
store of tokenized prefixes for the same reason). A self-check at load keeps the cuts whose
chunks give the whole text's tokens (the space cuts alone for a tokenizer that does not split
at newlines); a tokenizer that no cut suits is run on the whole text. Texts are always encoded
as a batch, which lets go of the GIL (a single ``encode`` holds it throughout, so a prompt
tokenized on a worker thread stopped the gateway's event loop for as long).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import heapq
import itertools
import json
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import orjson
from tokenizers import Tokenizer

from baton.core.sim_tokenizer import encode_token_ids, render_chat

__all__ = [
    "ChunkedEncoder",
    "HFTokenizer",
    "PromptTokenizer",
    "ShortestFirst",
    "SimTokenizer",
    "check_tokenizer",
    "chunk_ends",
    "load_tokenizer",
    "prompt_as_ids",
    "usable_cores",
]

T = TypeVar("T")

# Characters a chunk runs to before it is cut at the next place the text allows: about a
# thousand tokens, so that a prompt continuing a cached one re-tokenizes about that much.
CHUNK_CHARS = 4096
# Token ids kept for chunks already tokenized, over every prompt (4 bytes each): 16M tokens,
# a few hundred of the longest agentic prompts.
TOKEN_CACHE_BYTES = 64 * 2**20
# Where a byte-level BPE's pre-tokenizer (GPT-2's, Llama 3's, Qwen's, DeepSeek's expressions)
# ends a piece whatever follows: before a lone space between two letters (the space opens the
# next word's piece), and after a lone newline between a non-space and a letter. A tokenizer
# that splits only at spaces (a word-level one) keeps the first.
_SPACE_CUT = r"(?<=[^\W\d_]) (?=[^\W\d_])"
_NEWLINE_CUT = r"(?<=\S\n)(?=[^\W\d_])"
_CUT = re.compile(f"{_SPACE_CUT}|{_NEWLINE_CUT}")
_CUTS = (_CUT, re.compile(_SPACE_CUT))  # the first whose chunks give the whole text's tokens
# Text with both kinds of cut, tokenized whole and in chunks when a tokenizer is loaded.
_SELF_CHECK = (
    "Route the prefill, then the decode rank.\nHandoff: KV blocks move over NIXL; "
    "the cell's trays hold 4 GPUs each.\nDEP32 decode groups balance 256 experts. "
)


class PromptTokenizer(Protocol):
    # True where tokenizing a long prompt takes long enough to run off the event loop
    blocking: bool
    # True where the ids are the engines' own (their tokenizer's files): a completion's prompt
    # may go to them as ids (:func:`prompt_as_ids`)
    engines_ids: bool

    def packed(self, body: Mapping[str, object]) -> bytes | None:
        """The request's prompt token ids, 4 little-endian bytes each; None when unknown."""
        ...


def _chat_options(body: Mapping[str, object]) -> tuple[list[object], bool] | None:
    """The messages and ``add_generation_prompt`` of a chat body the engine renders plainly;
    None for anything else (no messages, a final message to continue)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or body.get("continue_final_message"):
        return None
    return messages, body.get("add_generation_prompt", True) is not False


class SimTokenizer:
    """``baton sim``'s tokenizer: its chat template, 4 bytes a token."""

    blocking = False
    engines_ids = True  # the simulator's ids are its text's 4-byte words

    def packed(self, body: Mapping[str, object]) -> bytes | None:
        chat = _chat_options(body)
        if chat is not None:
            messages, generation = chat
            if not all(isinstance(message, Mapping) for message in messages):
                return None
            return render_chat(messages, generation)  # type: ignore[arg-type]
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt.encode()
        if isinstance(prompt, list) and all(
            isinstance(item, int) and 0 <= item < 2**32 for item in prompt
        ):
            return encode_token_ids(prompt)
        return None


def chunk_ends(text: str, every: int = CHUNK_CHARS, cuts: re.Pattern[str] = _CUT) -> list[int]:
    """Where ``text``'s chunks end: at the first of ``cuts`` at least ``every`` characters
    past the last; the final end is the text's. A cut depends only on the characters around it,
    so two texts sharing a prefix share the ends within it."""
    ends: list[int] = []
    start = 0
    while (cut := cuts.search(text, start + every)) is not None:
        ends.append(cut.start())
        start = cut.start()
    ends.append(len(text))
    return ends


def _pieces(text: str, every: int, cuts: re.Pattern[str]) -> list[str]:
    """``text`` cut at :func:`chunk_ends`."""
    ends = chunk_ends(text, every, cuts)
    return [text[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]


class ChunkedEncoder:
    """A tokenizer's ids for long texts, encoded in chunks (:func:`chunk_ends`) and kept per
    chunk, least recently used forgotten past ``cache_bytes`` of ids. Thread-safe: prompts are
    tokenized on worker threads."""

    def __init__(self, tokenizer: Tokenizer, cache_bytes: int = TOKEN_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.cache_bytes = cache_bytes
        self._chunks: OrderedDict[bytes, bytes] = OrderedDict()  # text hash to its chunk's ids
        self._held = 0  # bytes of ids in _chunks
        self._lock = threading.Lock()
        # tokens a completion prompt gets around its text (BOS, ...), None: not separable
        self._special = self._special_tokens()
        # where the chunks are cut: the first rule whose chunks' ids are the whole text's, on a
        # text with both kinds of cut, and that cuts no added token; None: never
        whole = self._ids([_SELF_CHECK])
        added = _added_texts(tokenizer)
        self.cuts = next(
            (
                cuts
                for cuts in _CUTS
                if self._ids(_pieces(_SELF_CHECK, 1, cuts)) == whole
                and not any(len(chunk_ends(t, 1, cuts)) > 1 for t in added)
            ),
            None,
        )

    @property
    def held_bytes(self) -> int:
        """Bytes of token ids the cache holds."""
        return self._held

    def packed(self, text: str, *, special: bool) -> bytes:
        """``text``'s ids, 4 little-endian bytes each; with the tokenizer's special tokens around
        them when ``special``."""
        around = self._special if special else (b"", b"")
        if self.cuts is None or around is None:
            (whole,) = self.tokenizer.encode_batch([text], add_special_tokens=special)
            return _pack(whole.ids)
        before, after = around
        return before + self._chunked(text, self.cuts) + after

    def _chunked(self, text: str, cuts: re.Pattern[str]) -> bytes:
        pieces = _pieces(text, CHUNK_CHARS, cuts)
        keys: list[bytes] = []
        key = b""
        for piece in pieces[:-1]:  # the last one is not kept: a longer text cuts it elsewhere
            key = hashlib.blake2b(key + piece.encode(), digest_size=16).digest()
            keys.append(key)
        parts: list[bytes] = []
        with self._lock:
            for key in keys:
                ids = self._chunks.get(key)
                if ids is None:
                    break
                self._chunks.move_to_end(key)
                parts.append(ids)
        encoded = [_pack(ids) for ids in self._encode(pieces[len(parts) :])]
        with self._lock:
            for key, ids in zip(keys[len(parts) :], encoded, strict=False):
                if key not in self._chunks:
                    self._held += len(ids)
                self._chunks[key] = ids
            while self._held > self.cache_bytes and self._chunks:
                self._held -= len(self._chunks.popitem(last=False)[1])
        return b"".join(parts + encoded)

    def _encode(self, pieces: Sequence[str]) -> list[list[int]]:
        """Each piece's ids, without special tokens, as one batch: in parallel, and with the GIL
        let go (``Tokenizer.encode`` holds it throughout, which stops the gateway's event loop
        for as long as a prompt takes)."""
        return [e.ids for e in self.tokenizer.encode_batch(list(pieces), add_special_tokens=False)]

    def _ids(self, pieces: Sequence[str]) -> list[int]:
        return [token for ids in self._encode(pieces) for token in ids]

    def _special_tokens(self) -> tuple[bytes, bytes] | None:
        """The ids the post-processor puts before and after a text's own, from a probe."""
        plain = list(self.tokenizer.encode("a", add_special_tokens=False).ids)
        full = list(self.tokenizer.encode("a", add_special_tokens=True).ids)
        for at in range(len(full) - len(plain) + 1):
            if full[at : at + len(plain)] == plain:
                return _pack(full[:at]), _pack(full[at + len(plain) :])
        return None


class HFTokenizer:
    """A model's Hugging Face tokenizer and chat template, from its files."""

    blocking = True
    engines_ids = True

    def __init__(self, directory: str | Path) -> None:
        folder = Path(directory)
        check_tokenizer(str(folder))
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.encoder = ChunkedEncoder(self.tokenizer)
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special_tokens = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        self.template = self._template(folder, config)

    @staticmethod
    def _template(folder: Path, config: Mapping[str, object]) -> jinja2.Template | None:
        standalone = folder / "chat_template.jinja"
        text: object = (
            standalone.read_text() if standalone.is_file() else config.get("chat_template")
        )
        if isinstance(text, list):  # named templates: the default one serves chats
            named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
            text = named.get("default")
        if not isinstance(text, str):
            return None
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return environment.from_string(text)

    def packed(self, body: Mapping[str, object]) -> bytes | None:
        chat = _chat_options(body)
        if chat is not None:
            if self.template is None:
                return None
            messages, generation = chat
            extra = body.get("chat_template_kwargs")
            try:
                text = self.template.render(
                    messages=[_string_content(message) for message in messages],
                    add_generation_prompt=generation,
                    tools=body.get("tools"),
                    documents=body.get("documents"),
                    **self.special_tokens,
                    **(extra if isinstance(extra, dict) else {}),
                )
            except (jinja2.TemplateError, TypeError, ValueError):
                return None
            return self._encode(text, special=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt, special=body.get("add_special_tokens", True) is not False)
        if isinstance(prompt, list) and all(
            isinstance(item, int) and 0 <= item < 2**32 for item in prompt
        ):
            return _pack(prompt)
        return None

    def _encode(self, text: str, *, special: bool) -> bytes:
        return self.encoder.packed(text, special=special)


class ShortestFirst(Generic[T]):
    """Prompts waiting for the tokenizer, run on worker threads as many at once as the gateway
    has cores (:func:`usable_cores`), the smallest waiting first. Prompts arrive together (a
    trace's requests stamped to the second, an agent's fan-out), and in arrival order a short
    prompt waits for every long one before it (docs/benchmarks.md, "The gateway's time before
    its first leg")."""

    def __init__(self, work: Callable[[Mapping[str, object]], T], workers: int = 0) -> None:
        """``workers``: threads at once; 0, :func:`usable_cores` counted at first use (a
        benchmark pins the gateway after it starts)."""
        self._work = work
        self._waiting: list[tuple[int, int, Mapping[str, object], asyncio.Future[T]]] = []
        self._order = itertools.count()
        self._running = 0
        self._workers = workers

    async def run(self, body: Mapping[str, object], size: int) -> T:
        """``work(body)`` on a worker thread once no smaller waiting prompt is left; ``size``
        orders it (the request's bytes)."""
        answer: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (size, next(self._order), body, answer))
        self._start()
        return await answer

    def _start(self) -> None:
        if not self._workers:
            self._workers = usable_cores()
        while self._waiting and self._running < self._workers:
            _, _, body, answer = heapq.heappop(self._waiting)
            if answer.done():  # its request left while it waited
                continue
            self._running += 1
            task = asyncio.ensure_future(asyncio.to_thread(self._work, body))
            task.add_done_callback(functools.partial(self._finished, answer))

    def _finished(self, answer: asyncio.Future[T], task: asyncio.Future[T]) -> None:
        self._running -= 1
        if task.cancelled():  # the loop is closing
            answer.cancel()
        elif (error := task.exception()) is not None:  # retrieved even where no one waits
            if not answer.done():
                answer.set_exception(error)
        elif not answer.done():
            answer.set_result(task.result())
        self._start()


def usable_cores(
    cgroups: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> int:
    """The cores this process can keep busy at once: those it may run on, fewer where a CPU
    quota of its cgroup or one above it allows fewer (a container's CPU limit: past it the
    kernel throttles every thread of the pod, the event loop's too, until the next period).
    cgroup v2's ``cpu.max`` and v1's ``cpu.cfs_quota_us``; a file that is missing or unreadable
    sets no bound."""
    cores = len(os.sched_getaffinity(0))
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return cores
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: one hierarchy
            mounts, read = [cgroups], _quota_v2
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            mounts, read = [cgroups / controllers, cgroups / "cpu"], _quota_v1
        else:
            continue
        for mount in mounts:
            # from the process's own cgroup up to the hierarchy's root, which is all a
            # container with its own cgroup namespace sees
            directory = mount / path.lstrip("/")
            for level in [directory, *directory.parents]:
                if level == mount.parent:
                    break
                if (quota := read(level)) is not None:
                    cores = min(cores, max(1, math.ceil(quota)))
    return cores


def _quota_v2(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _quota_v1(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 else quota / period


def prompt_as_ids(body: Mapping[str, object], packed: bytes | None) -> bytes | None:
    """The ``"prompt": [ids]`` field a completion's legs may carry instead of its text, from the
    engines' own tokenizer's ``packed`` ids, or None where the text must go: vLLM stamps a
    request's arrival before it tokenizes the prompt (0.33's ``render_cmpl``), so each engine
    would take the time again that the gateway already took to route it. Only a single text
    prompt whose text the engine does not use beyond its ids: not with ``echo`` (the engine
    would echo its detokenized ids) or ``truncate_prompt_tokens`` (kept on text)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if packed is None or not isinstance(prompt, str) or "messages" in body:
        return None
    if len(packed) % 4:  # not whole ids (a simulator's text of no whole number of tokens)
        return None
    if body.get("echo") or body.get("truncate_prompt_tokens") is not None:
        return None
    ids = np.frombuffer(packed, dtype="<u4")
    return orjson.dumps({"prompt": ids}, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]


def check_tokenizer(value: str) -> None:
    """ValueError unless ``value`` is ``sim`` or a directory holding ``tokenizer.json``."""
    if value != "sim" and not (Path(value) / "tokenizer.json").is_file():
        raise ValueError(
            f"no tokenizer.json in {value}: give the model's directory (the files vLLM reads "
            "its tokenizer from), or 'sim' for baton sim engines"
        )


def load_tokenizer(value: str) -> PromptTokenizer:
    """``--tokenizer``: ``sim``, or the directory of a model's tokenizer files."""
    return SimTokenizer() if value == "sim" else HFTokenizer(value)


def _pack(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def _added_texts(tokenizer: Tokenizer) -> list[str]:
    """The added tokens' texts (special and not): matched before the pre-tokenizer, so a cut
    inside one would split it."""
    return [token.content for token in tokenizer.get_added_tokens_decoder().values()]


def _token_text(token: object) -> str | None:
    if isinstance(token, dict):  # an AddedToken as transformers saves it
        content = token.get("content")
        return content if isinstance(content, str) else None
    return token if isinstance(token, str) else None


def _string_content(message: object) -> object:
    """A message with its content as vLLM's "string" content format gives it to a template:
    a list of text parts joined by newlines."""
    if not isinstance(message, Mapping):
        return message
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = [
        str(part.get("text", ""))
        for part in content
        if isinstance(part, Mapping) and part.get("type", "text") == "text"
    ]
    return {**message, "content": "\n".join(texts)}


def _tojson(
    value: object, ensure_ascii: bool = False, indent: int | None = None, **_: object
) -> str:
    # transformers' tojson: no HTML escaping (Jinja's own escapes '<', which chat tokens use)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
