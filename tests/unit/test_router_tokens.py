"""router/tokens.py: a prompt's token ids as the engine will see them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors, trainers

from baton.core.sim_tokenizer import encode_token_ids, render_chat
from router.settings import GatewaySettings
from router.tokens import (
    ChunkedEncoder,
    HFTokenizer,
    ShortestFirst,
    SimTokenizer,
    chunk_ends,
    load_tokenizer,
    prompt_as_ids,
    usable_cores,
)

MESSAGES: list[dict[str, object]] = [
    {"role": "system", "content": "You route prefills."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Which rank?"}, {"type": "text", "text": "Now."}],
    },
]
# A template in the style of the models' own: the BOS token variable, a loop with `loop`
# controls, tojson of a tool list, raise_exception for a role it does not know.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
    "{% if loop.last and tools %}<|tools|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tools|>"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model's tokenizer files as transformers saves them: a byte-level BPE trained here, its
    post-processor adding BOS, and the chat template in tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("model")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["which rank routes the prefill now"] * 50, trainer=trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
    )
    bpe.save(str(folder / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>"}, "eos_token": "<|end|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def ids(packed: bytes | None) -> list[int]:
    assert packed is not None
    return [int(token) for token in np.frombuffer(packed, dtype="<u4")]


def test_the_sim_tokenizer_is_the_simulators_template_and_byte_rule() -> None:
    tokens = SimTokenizer()
    assert tokens.packed({"messages": MESSAGES}) == render_chat(MESSAGES)
    assert tokens.packed({"messages": MESSAGES, "add_generation_prompt": False}) == render_chat(
        MESSAGES, False
    )
    assert tokens.packed({"prompt": "abcd efgh"}) == b"abcd efgh"
    assert tokens.packed({"prompt": ["abcd"]}) == b"abcd"
    assert tokens.packed({"prompt": [7, 2**31]}) == encode_token_ids([7, 2**31])
    # what the engine renders otherwise, or refuses, is not guessed at
    assert tokens.packed({"messages": MESSAGES, "continue_final_message": True}) is None
    assert tokens.packed({"prompt": [-1]}) is None
    assert tokens.packed({"prompt": ["a", "b"]}) is None


def test_a_chat_is_rendered_with_the_models_template_and_tokenized_without_special_tokens(
    model_dir: Path,
) -> None:
    tokens = HFTokenizer(model_dir)
    tools = [{"type": "function", "function": {"name": "route<1>"}}]
    rendered = (
        "<s><|system|>You route prefills.<|end|>\n<|user|>Which rank?\nNow.<|end|>\n"
        '<|tools|>[{"type": "function", "function": {"name": "route<1>"}}]<|end|><|assistant|>'
    )
    expected = tokens.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert ids(tokens.packed({"messages": MESSAGES, "tools": tools})) == expected
    assert expected[0] == tokens.tokenizer.token_to_id("<s>")  # once: the template's, not twice


def test_a_completion_prompt_gets_the_tokenizers_special_tokens_unless_asked_not_to(
    model_dir: Path,
) -> None:
    tokens = HFTokenizer(model_dir)
    bos = tokens.tokenizer.token_to_id("<s>")
    plain = tokens.tokenizer.encode("which rank", add_special_tokens=False).ids
    assert ids(tokens.packed({"prompt": "which rank"})) == [bos, *plain]
    assert ids(tokens.packed({"prompt": "which rank", "add_special_tokens": False})) == plain
    assert ids(tokens.packed({"prompt": [5, 6, 7]})) == [5, 6, 7]


def test_a_completions_text_prompt_goes_to_the_engines_as_its_ids_where_nothing_needs_the_text(
    model_dir: Path,
) -> None:
    tokens = HFTokenizer(model_dir)
    assert tokens.engines_ids and SimTokenizer.engines_ids

    def sent(body: dict[str, object]) -> object:
        field = prompt_as_ids(body, tokens.packed(body))
        return None if field is None else json.loads(b"{" + field + b"}")["prompt"]

    for prompt in ("which rank", ["which rank"]):
        assert sent({"prompt": prompt}) == ids(tokens.packed({"prompt": "which rank"}))
    assert sent({"prompt": "which rank", "add_special_tokens": False}) == ids(
        tokens.packed({"prompt": "which rank", "add_special_tokens": False})
    )
    # the engine would echo its detokenized ids, or cut the text as it cuts text
    assert sent({"prompt": "which rank", "echo": True}) is None
    assert sent({"prompt": "which rank", "truncate_prompt_tokens": 4}) is None
    # ids already, several prompts, a chat: as the client sent them
    assert sent({"prompt": [5, 6, 7]}) is None
    assert sent({"prompt": ["one", "two"]}) is None
    assert sent({"messages": [{"role": "user", "content": "which rank"}]}) is None


def test_a_simulators_text_goes_as_ids_only_where_it_is_whole_tokens() -> None:
    tokens = SimTokenizer()
    whole = {"prompt": "four bytes a token!!"}  # 20 bytes
    field = prompt_as_ids(whole, tokens.packed(whole))
    assert field is not None
    sent = json.loads(b"{" + field + b"}")["prompt"]
    assert encode_token_ids(sent) == b"four bytes a token!!"
    ragged = {"prompt": "three more"}  # 10 bytes: no ids carry it exactly
    assert prompt_as_ids(ragged, tokens.packed(ragged)) is None


def test_a_chat_the_template_refuses_or_cannot_render_is_not_keyed(model_dir: Path) -> None:
    tokens = HFTokenizer(model_dir)
    assert tokens.packed({"messages": [{"role": "tool", "content": "x"}]}) is None
    bare = model_dir.parent / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    assert HFTokenizer(bare).packed({"messages": MESSAGES}) is None  # no chat template
    assert ids(load_tokenizer(str(bare)).packed({"prompt": [1]})) == [1]


def test_a_tokenizer_directory_without_its_files_is_refused_naming_the_flag(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        HFTokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"--tokenizer: .*no tokenizer\.json in"):
        GatewaySettings.from_flags(_flags(tokenizer=str(tmp_path)))
    with pytest.raises(ValueError, match=r"--kv-events-port: .*give --tokenizer too"):
        GatewaySettings.from_flags(_flags(kv_events_port=5557))
    assert GatewaySettings.from_flags(_flags(tokenizer="sim", kv_events_port=5557)).tokenizer


def _flags(**values: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    GatewaySettings.add_flags(parser)
    args = parser.parse_args([])
    for name, value in values.items():
        setattr(args, name, value)
    return args


class _Recorder:
    """A real tokenizer, recording the texts it is asked to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> object:
        self.texts.append(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> object:
        self.texts.extend(texts)
        return self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)

    def get_added_tokens_decoder(self) -> object:
        return self.tokenizer.get_added_tokens_decoder()


def _prose(words: int, seed: int) -> str:
    rng = random.Random(seed)
    vocabulary = ["which", "rank", "routes", "the", "prefill", "now", "é", "中文", "x=1;", "(a)"]
    parts = [rng.choice(vocabulary) for _ in range(words)]
    return "".join(
        p + rng.choice([" ", " ", " ", "  ", "\n", ".\n", "\n\n", "\t", ", "]) for p in parts
    )


def test_a_long_prompts_chunks_give_the_whole_texts_tokens(model_dir: Path) -> None:
    tokens = HFTokenizer(model_dir)
    assert tokens.encoder.cuts is not None
    whole = tokens.tokenizer
    for seed in range(20):
        text = _prose(3000 + 500 * seed, seed)
        assert len(chunk_ends(text)) > 1
        assert ids(tokens.packed({"prompt": text})) == whole.encode(text).ids
        assert ids(tokens.packed({"prompt": text, "add_special_tokens": False})) == (
            whole.encode(text, add_special_tokens=False).ids
        )


def test_a_prompt_continuing_an_earlier_one_tokenizes_only_what_is_new(model_dir: Path) -> None:
    recorder = _Recorder(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    encoder = ChunkedEncoder(recorder)  # type: ignore[arg-type]
    first = _prose(20_000, 1)
    encoder.packed(first, special=False)
    recorder.texts.clear()
    second = first + "and the decode rank answers.\nwhich rank now"
    assert (
        encoder.packed(second, special=False)
        == np.asarray(
            recorder.tokenizer.encode(second, add_special_tokens=False).ids, dtype="<u4"
        ).tobytes()
    )
    # the chunks before the last cut in the first prompt came from the cache
    assert sum(len(text) for text in recorder.texts) <= len(second) - chunk_ends(first)[-2]


def test_the_chunk_cache_keeps_its_bound(model_dir: Path) -> None:
    encoder = ChunkedEncoder(Tokenizer.from_file(str(model_dir / "tokenizer.json")), 50_000)
    for seed in range(10):
        encoder.packed(_prose(20_000, seed), special=False)
    assert 0 < encoder.held_bytes <= 50_000


def test_a_tokenizer_that_splits_only_at_spaces_is_chunked_at_spaces() -> None:
    # a word-level tokenizer whose words run to the next space, newlines within them (the GPU
    # benchmark's model has one): cut after a newline, a chunk would split a word
    words = Tokenizer(models.WordLevel({"[unk]": 0}, unk_token="[unk]"))
    words.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[^ ]+| "), behavior="isolated")
    trainer = trainers.WordLevelTrainer(special_tokens=["[unk]"], show_progress=False)
    words.train_from_iterator([_prose(2000, seed) for seed in range(3)], trainer=trainer)
    encoder = ChunkedEncoder(words)
    assert encoder.cuts is not None
    for seed in range(5):
        text = _prose(4000, seed)
        assert len(chunk_ends(text, cuts=encoder.cuts)) > 1
        assert encoder.packed(text, special=False) == (
            np.asarray(words.encode(text).ids, dtype="<u4").tobytes()
        )


def _metaspace(*, split: bool) -> Tokenizer:
    """SentencePiece's style: a word marker prepended to every text and put for every space;
    without ``split`` the text is not cut into words first, so a merge may span a space."""
    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=split)
    trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False)
    metaspace.train_from_iterator(["which rank routes the prefill now"] * 20, trainer=trainer)
    return metaspace


def test_a_word_marker_tokenizer_is_chunked_at_spaces_not_newlines() -> None:
    # after a newline a chunk would gain the marker the whole text has not there; a chunk that
    # begins with a space gets the marker the whole text has for it
    metaspace = _metaspace(split=True)
    encoder = ChunkedEncoder(metaspace)
    assert encoder.cuts is not None
    assert chunk_ends("rank\nroutes the prefill", 1, encoder.cuts) == [11, 15, 23]
    for seed in range(10):
        text = _prose(3000, seed)
        assert encoder.packed(text, special=False) == (
            np.asarray(metaspace.encode(text).ids, dtype="<u4").tobytes()
        )


def test_a_tokenizer_whose_chunks_would_differ_tokenizes_the_whole_text() -> None:
    unsplit = _metaspace(split=False)
    encoder = ChunkedEncoder(unsplit)
    assert encoder.cuts is None
    text = _prose(3000, 3)
    assert (
        encoder.packed(text, special=False)
        == np.asarray(unsplit.encode(text).ids, dtype="<u4").tobytes()
    )


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        # one chunk: no place to cut it, so it is encoded as one piece
        ("chunked", "x=1;(a)" * 60_000),
        # a tokenizer whose chunks would differ: the whole text at once
        ("whole", _prose(80_000, 5)),
    ],
)
def test_tokenizing_on_a_worker_thread_leaves_the_event_loop_running(
    model_dir: Path, kind: str, text: str
) -> None:
    """The gateway tokenizes a prompt on a worker thread; the tokenizer must let go of the GIL
    meanwhile, or the event loop, and every stream it relays, stops until the prompt is done."""
    if kind == "chunked":
        encoder = ChunkedEncoder(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
        assert encoder.cuts is not None and len(chunk_ends(text)) == 1
    else:
        encoder = ChunkedEncoder(_metaspace(split=False))
        assert encoder.cuts is None

    async def ticks_while_tokenizing() -> int:
        tokenizing = asyncio.ensure_future(asyncio.to_thread(encoder.packed, text, special=False))
        ticks = 0
        while not tokenizing.done():
            await asyncio.sleep(0)
            ticks += 1
        await tokenizing
        return ticks

    # with the GIL held through the encoding the loop got hundreds of ticks in while these
    # texts were tokenized (while the ids were packed); with it let go, tens of thousands
    assert asyncio.run(ticks_while_tokenizing()) >= 5_000


def _held_first(
    work: Callable[[Mapping[str, object]], str],
) -> tuple[Callable[[Mapping[str, object]], str], threading.Event, threading.Event]:
    """``work``, whose call for the prompt named "first" holds its worker until released."""
    started, release = threading.Event(), threading.Event()

    def held(body: Mapping[str, object]) -> str:
        if body["name"] == "first":
            started.set()
            release.wait(60)
        return work(body)

    return held, started, release


def test_prompts_waiting_for_the_tokenizer_go_smallest_first() -> None:
    # one worker (a gateway pinned to one core), held by the first prompt until the rest wait
    order: list[str] = []

    def tokenize(body: Mapping[str, object]) -> str:
        order.append(str(body["name"]))
        return "ids"

    work, started, release = _held_first(tokenize)

    async def burst() -> None:
        lane = ShortestFirst(work, workers=1)
        first = asyncio.ensure_future(lane.run({"name": "first"}, 50_000))
        await asyncio.to_thread(started.wait, 60)
        rest = [
            asyncio.ensure_future(lane.run({"name": name}, size))
            for name, size in (("long", 30_000), ("short", 1_000), ("middle", 9_000))
        ]
        await asyncio.sleep(0)
        release.set()
        assert await asyncio.gather(first, *rest) == ["ids"] * 4

    asyncio.run(burst())
    assert order == ["first", "short", "middle", "long"]


def test_a_prompt_whose_request_left_is_not_tokenized_and_errors_reach_their_request() -> None:
    done: list[str] = []

    def tokenize(body: Mapping[str, object]) -> str:
        if body["name"] == "bad":
            raise ValueError("the template raised")
        done.append(str(body["name"]))
        return str(body["name"])

    work, started, release = _held_first(tokenize)

    async def run() -> None:
        lane = ShortestFirst(work, workers=1)
        first = asyncio.ensure_future(lane.run({"name": "first"}, 10))
        await asyncio.to_thread(started.wait, 60)
        gone = asyncio.ensure_future(lane.run({"name": "gone"}, 1))
        bad = asyncio.ensure_future(lane.run({"name": "bad"}, 2))
        await asyncio.sleep(0)
        gone.cancel()  # the client disconnected while its prompt waited
        release.set()
        assert await first == "first"
        with pytest.raises(ValueError, match="template"):
            await bad
        # the lane goes on after both
        assert await lane.run({"name": "after"}, 5) == "after"

    asyncio.run(run())
    assert done == ["first", "after"]


def _cgroup_file(directory: Path, name: str, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)


def _member_of(tmp_path: Path, cgroups: str) -> tuple[Path, Path]:
    """A process's ``/proc/self/cgroup`` holding ``cgroups``, and an empty cgroup mount."""
    membership = tmp_path / "cgroup"
    membership.write_text(cgroups)
    return membership, tmp_path / "fs"


def test_usable_cores_are_bounded_by_the_cgroups_cpu_quota_v2(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    membership, root = _member_of(tmp_path, "0::/kubepods/pod1/gateway\n")
    _cgroup_file(root / "kubepods/pod1/gateway", "cpu.max", "max 100000\n")
    assert usable_cores(root, membership) == affinity  # no limit
    _cgroup_file(root / "kubepods/pod1", "cpu.max", "50000 100000\n")  # the pod's limit: 500m
    assert usable_cores(root, membership) == 1
    _cgroup_file(root / "kubepods/pod1", "cpu.max", f"{(affinity + 3) * 100000} 100000\n")
    assert usable_cores(root, membership) == affinity  # a quota past the cores it may run on


def test_usable_cores_read_cgroup_v1_and_a_containers_own_namespace(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    # a container with its own cgroup namespace: its path is not under the mount, its root is
    membership, root = _member_of(
        tmp_path, "4:memory:/x\n2:cpu,cpuacct:/kubepods/pod1/gateway\n1:name=systemd:/\n"
    )
    _cgroup_file(root / "cpu,cpuacct", "cpu.cfs_quota_us", "-1\n")
    _cgroup_file(root / "cpu,cpuacct", "cpu.cfs_period_us", "100000\n")
    assert usable_cores(root, membership) == affinity
    _cgroup_file(root / "cpu,cpuacct", "cpu.cfs_quota_us", "100000\n")
    assert usable_cores(root, membership) == 1
    # no cgroup files at all: the affinity alone
    assert usable_cores(tmp_path / "missing", tmp_path / "missing-membership") == affinity
