"""The model ``baton bench gpu`` serves, written on the machine that serves it: nothing is
downloaded. Run with the engines' python (transformers and tokenizers come with vLLM):
``model.py SHAPE OUT_DIR`` writes ``OUT_DIR/SHAPE``, a Hugging Face model directory without
weights (the engines load random ones: ``--load-format dummy``): ``config.json`` and a tokenizer.
``model.py --weights SHAPE OUT_DIR`` writes random weights too (seeded, ``model.safetensors``),
where the engines must hold one weight per expert: vLLM's dummy weights fill each rank's expert
tensor alike, slot by slot, so a redundant replica of an expert computes another expert's
function, and expert rebalancing (``baton bench gpu --step eplb``) would change the answers.

- ``deepseek-v2-lite-12l``: DeepSeek-V2-Lite's dimensions (huggingface.co/deepseek-ai/
  DeepSeek-V2-Lite: MLA with kv_lora_rank 512, rope 64, nope 128, v 128; layer 0 dense, then
  MoE with 64 routed experts of 1,408 and 2 shared, top-6; hidden 2,048, 16 heads, vocabulary
  102,400) cut to 12 layers: 13 GiB of bf16 weights, so that four engines share one H200.
- ``deepseek-v2-lite-6l``: the same cut to 6 layers (7 GiB), so that four engines share one
  H100 with as many tokens of KV cache each as on the H200 (a token's MLA cache is per layer).
- ``tiny-qwen3-moe``: the same tokenizer on a 4-layer Qwen3-MoE for the CPU build of vLLM, which
  caches prefixes for it (not for MLA), so that the benchmark's driver runs on CPU in ``make test``.

The tokenizer makes every word the benchmarks write (a space and three lowercase letters:
``bench.workload.text``) one token, so a replayed trace's prompt has the token count and the
512-token block boundaries the trace recorded. Its vocabulary is padded to the model's with
four-letter words so that every id a random model samples decodes.
"""

from __future__ import annotations

import itertools
import json
import string
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<|end|>", "<|pad|>", "<|unk|>"]
_COMMON = {"bos_token_id": None, "eos_token_id": 0, "pad_token_id": 1, "dtype": "bfloat16"}
WEIGHTS_SEED = 2026
_V2_LITE: dict[str, object] = {
    **_COMMON,
    "model_type": "deepseek_v2",
    "architectures": ["DeepseekV2ForCausalLM"],
    "vocab_size": 102_400,
    "hidden_size": 2048,
    "intermediate_size": 10_944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    # the trace's longest request (prompt and output) is 122K tokens
    "max_position_embeddings": 131_072,
    "rope_theta": 10_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
CONFIGS: dict[str, dict[str, object]] = {
    "deepseek-v2-lite-12l": _V2_LITE,
    "deepseek-v2-lite-6l": {**_V2_LITE, "num_hidden_layers": 6},
    "tiny-qwen3-moe": {
        **_COMMON,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 17_664,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "max_position_embeddings": 8192,
        "rope_theta": 10_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
}


def vocabulary(size: int) -> list[str]:
    """The special tokens, every ' abc' word, then ' abcd' words up to ``size``."""
    words = [" " + "".join(w) for w in itertools.product(string.ascii_lowercase, repeat=3)]
    padding = (" " + "".join(w) for w in itertools.product(string.ascii_lowercase, repeat=4))
    entries = SPECIAL + words
    if size < len(entries):
        raise ValueError(f"a vocabulary of {size} cannot hold the {len(entries)} words")
    return entries + list(itertools.islice(padding, size - len(entries)))


def tokenizer(size: int, max_length: int) -> PreTrainedTokenizerFast:
    entries = vocabulary(size)
    word_level = Tokenizer(
        models.WordLevel({token: i for i, token in enumerate(entries)}, unk_token="<|unk|>")
    )
    # a word is a space and its letters; anything else is one unknown token per piece
    word_level.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[^ ]+| "), behavior="isolated")
    word_level.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        eos_token="<|end|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        model_max_length=max_length,
        # chat requests (baton bench gpu --step agentx): the messages' words in order, so a
        # conversation's prompt is the earlier turn's prompt extended, as a chat template makes it
        chat_template="{% for message in messages %}{{ message['content'] }}{% endfor %}",
    )


def build(out: Path, shape: str, weights: bool = False) -> Path:
    config = CONFIGS[shape]
    target = out / shape
    target.mkdir(parents=True, exist_ok=True)
    if weights and not (target / "model.safetensors").exists():
        torch.manual_seed(WEIGHTS_SEED)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**config), dtype=torch.bfloat16
        )
        model.save_pretrained(target, safe_serialization=True, max_shard_size="100GB")
    AutoConfig.for_model(**config).save_pretrained(target)
    # vLLM reads the served dtype and token ids from config.json: keep them as written above
    written = json.loads((target / "config.json").read_text())
    written.update({k: v for k, v in config.items() if k in _COMMON})
    (target / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    vocab, length = config["vocab_size"], config["max_position_embeddings"]
    assert isinstance(vocab, int) and isinstance(length, int)
    fast = tokenizer(vocab, length)
    fast.save_pretrained(target)
    return target


def main() -> None:
    arguments = sys.argv[1:]
    weights = arguments[:1] == ["--weights"]
    arguments = arguments[weights:]
    if len(arguments) != 2 or arguments[0] not in CONFIGS:
        raise SystemExit(f"usage: model.py [--weights] {{{','.join(CONFIGS)}}} OUT_DIR")
    print(build(Path(arguments[1]), arguments[0], weights))


if __name__ == "__main__":
    main()
