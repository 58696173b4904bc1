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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Protocol

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from tokenizers import Tokenizer

from baton.core.sim_tokenizer import encode_token_ids, render_chat

__all__ = ["HFTokenizer", "PromptTokenizer", "SimTokenizer", "check_tokenizer", "load_tokenizer"]


class PromptTokenizer(Protocol):
    # True where tokenizing a long prompt takes long enough to run off the event loop
    blocking: bool

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


class HFTokenizer:
    """A model's Hugging Face tokenizer and chat template, from its files."""

    blocking = True

    def __init__(self, directory: str | Path) -> None:
        folder = Path(directory)
        check_tokenizer(str(folder))
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
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
            return np.asarray(prompt, dtype="<u4").tobytes()
        return None

    def _encode(self, text: str, *, special: bool) -> bytes:
        ids = self.tokenizer.encode(text, add_special_tokens=special).ids
        return np.asarray(ids, dtype="<u4").tobytes()


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
