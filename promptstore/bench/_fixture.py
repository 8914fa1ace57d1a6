"""The tiny random-weight fixture models, built in mlx-lm's on-disk format.

``fixtures/make_fixtures.py`` writes the repository's committed copies with
this module; ``promptstore bench`` builds the one it needs (the hybrid,
``qwen3_next``) into its scratch folder when it runs from an installed package,
where the repository's ``fixtures/`` is absent. Either way the files are the
same bytes.

Every model directory holds ``config.json``, ``model.safetensors`` and the
tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``), and loads fully offline with
``mlx_lm.load(path)``:

* ``llama``        dense llama, every layer a ``KVCache``
* ``qwen3_next``   hybrid: gated-DeltaNet layers (``ArraysCache``) + full
                   attention (``KVCache``), tiny MoE MLPs
* ``qwen3_5``      hybrid like qwen3_next (dense MLP), text-only config with
                   a nested ``text_config``
* ``gemma3_text``  sliding-window: ``RotatingKVCache`` (window 16) mixed with
                   global ``KVCache`` layers

All models share one small byte-level BPE tokenizer (512 tokens, ChatML chat
template) trained here on a built-in corpus (``tokenizers``, which mlx-lm's
``transformers`` brings). Attention head_dim is 64 in every model so mlx-lm's
quantized KV cache (group size 64) works.

The output is deterministic: building twice gives byte-identical files.
Weights come from numpy ``default_rng`` seeded per tensor (model seed +
CRC32 of the tensor name), safetensors are written with sorted keys and
constant metadata, JSON with ``sort_keys`` and a fixed indent.
``tests/test_fixtures.py`` checks that the committed files match a fresh run.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

__all__ = ["MODEL_NAMES", "HYBRID", "FIXTURES_ENV", "write_fixtures", "fixture_model"]

MODEL_NAMES = ("llama", "qwen3_next", "qwen3_5", "gemma3_text")
HYBRID = "qwen3_next"
# A folder of fixture models to use instead of the repository's (tests point
# it at an empty folder to run the bench as an installed package would).
FIXTURES_ENV = "PROMPTSTORE_FIXTURES"
_REPO_MODELS = Path(__file__).resolve().parents[2] / "fixtures" / "models"


def write_fixtures(out_dir: Path, names: Optional[Sequence[str]] = None) -> List[Path]:
    """Build the fixture models ``names`` (default: all) under ``out_dir``.

    Returns:
        The model directories written, in order.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok_files = tokenizer_files(tok)
    specs = model_specs(tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN))
    wanted = list(specs) if names is None else list(names)
    unknown = [n for n in wanted if n not in specs]
    if unknown:
        raise ValueError(f"unknown fixture model(s) {unknown}: known are {', '.join(specs)}")
    return [write_model(out_dir, name, specs[name], tok_files) for name in wanted]


def fixture_model(name: str, scratch: Path) -> Path:
    """The directory of fixture model ``name``: the one in ``$PROMPTSTORE_FIXTURES``
    (default: the repository's ``fixtures/models``) when it is there, else one
    built into ``scratch`` (an installed package ships no fixtures).
    """
    given = os.environ.get(FIXTURES_ENV)
    found = (Path(given).expanduser() if given else _REPO_MODELS) / name
    if (found / "config.json").is_file() and (found / "model.safetensors").is_file():
        return found
    return write_fixtures(Path(scratch) / "fixtures", [name])[0]


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A stitch in time saves nine.
Once upon a time there was a small model that lived inside a prompt cache.
Every morning it woke up, read the prompt again, and stored the keys and the
values for each layer so that the next request would be faster than the last.
Hello, how are you today? I am fine, thank you. What is the weather like?
It is sunny and warm outside, but the forecast says it will rain tomorrow.
The user asked the assistant a question, and the assistant answered with a
short and helpful reply. Then the user asked another question about history.
Python is a programming language. It has lists, dictionaries, functions and
classes. You can write a function that returns the sum of two numbers.
def add(a, b):
    return a + b
Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 and 2025 are common.
Water boils at one hundred degrees and freezes at zero degrees Celsius.
The sun rises in the east and sets in the west. The moon orbits the earth.
Cats and dogs are popular pets. Birds can fly, and fish swim in the sea.
Please summarize the following document in three sentences or fewer.
Translate this sentence into French: the book is on the table.
The database stores each entry under a key, and readers never block writers.
A transaction either commits all of its changes or none of them at all.
Memory maps let the operating system page data in from disk on demand.
Tokens are grouped into blocks, and every block is identified by a hash.
If two prompts share a prefix, the cached state for that prefix is reused.
Sliding windows keep only the most recent tokens; older ones are dropped.
Linear attention layers keep a fixed size state instead of a growing cache.
Good morning! Good evening! Thank you very much. You are welcome. Goodbye.
"""


# Qwen-style pre-tokenization (NFC + this split regex + byte-level). transformers
# 5 ignores tokenizer.json's pipeline for some model types (e.g. qwen3_5 is
# always rebuilt as Qwen3_5Tokenizer with exactly this pipeline), so using it
# everywhere keeps the encoding identical for all fixture models.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer() -> Any:
    """The fixtures' byte-level BPE tokenizer, trained on :data:`CORPUS`."""
    # Imported here: only building a fixture needs tokenizers (which mlx-lm's
    # transformers brings), never the bench's other cases.
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    return tok


def tokenizer_files(tok: Any) -> Dict[str, str]:
    """Return {file name: text} for the tokenizer files."""
    # Round-trip through json so the layout is independent of the tokenizers
    # pretty-printer and keys are sorted.
    tokenizer_json = json.loads(tok.to_str())
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added_tokens_decoder = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    special_tokens_map = {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
    }
    return {
        "tokenizer.json": dumps(tokenizer_json),
        "tokenizer_config.json": dumps(tokenizer_config),
        "special_tokens_map.json": dumps(special_tokens_map),
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------------------
# Model configs
# ---------------------------------------------------------------------------


def model_specs(eos_id: int, pad_id: int) -> Dict[str, Dict[str, Any]]:
    common = {"eos_token_id": eos_id, "pad_token_id": pad_id, "vocab_size": VOCAB_SIZE}
    return {
        "llama": {
            "seed": 1,
            "dtype": "bfloat16",
            "config": {
                **common,
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-05,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
            },
        },
        "qwen3_next": {
            "seed": 2,
            # float32: mlx's CPU GatherMM (used by the MoE SwitchGLU) only
            # supports float32, so a half-precision MoE model cannot run on CPU.
            "dtype": "float32",
            "config": {
                **common,
                "architectures": ["Qwen3NextForCausalLM"],
                "model_type": "qwen3_next",
                "hidden_size": 64,
                "intermediate_size": 64,
                "num_hidden_layers": 4,
                "full_attention_interval": 2,  # layers 1 and 3: full attention
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 64,
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000.0,
                "rope_scaling": None,
                "max_position_embeddings": 4096,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 2,
                "linear_key_head_dim": 32,
                "linear_value_head_dim": 32,
                "linear_conv_kernel_dim": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 16,
                "norm_topk_prob": True,
                "rms_norm_eps": 1e-06,
                "attention_bias": False,
                "tie_word_embeddings": True,
            },
        },
        "qwen3_5": {
            "seed": 3,
            "dtype": "float16",
            "config": {
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "model_type": "qwen3_5",
                "eos_token_id": eos_id,
                "pad_token_id": pad_id,
                "tie_word_embeddings": True,
                "text_config": {
                    **common,
                    "model_type": "qwen3_5_text",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_hidden_layers": 4,
                    "full_attention_interval": 2,  # layers 1 and 3: full attention
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 64,
                    "max_position_embeddings": 4096,
                    "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4,
                    "linear_key_head_dim": 32,
                    "linear_value_head_dim": 32,
                    "linear_conv_kernel_dim": 4,
                    "rms_norm_eps": 1e-06,
                    "attention_bias": False,
                    "tie_word_embeddings": True,
                    "rope_parameters": {
                        "mrope_interleaved": True,
                        "mrope_section": [4, 2, 2],
                        "partial_rotary_factor": 0.25,
                        "rope_theta": 10000.0,
                        "rope_type": "default",
                    },
                },
            },
        },
        "gemma3_text": {
            "seed": 4,
            "dtype": "bfloat16",
            # Like real Gemma 3 checkpoints: no lm_head, sanitize() then ties
            # the output projection to embed_tokens.
            "drop": ["lm_head.weight"],
            "config": {
                **common,
                "architectures": ["Gemma3ForCausalLM"],
                "model_type": "gemma3_text",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 64,
                "query_pre_attn_scalar": 64,
                "rms_norm_eps": 1e-06,
                "rope_theta": 1000000.0,
                "rope_local_base_freq": 10000.0,
                "rope_scaling": None,
                "sliding_window": 16,
                "sliding_window_pattern": 2,  # layers 1 and 3: global attention
                "max_position_embeddings": 4096,
            },
        },
    }


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------

EMBED_STD = 0.02


def init_tensor(model_type: str, name: str, shape: Tuple[int, ...], seed: int) -> np.ndarray:
    """Deterministic value for one parameter, from its name and shape only.

    Norm weights are the identity, embeddings N(0, 0.02), every projection
    N(0, 1/fan_in) so activations keep unit scale through the layers and the
    residual stream is not dominated by the (tied) embedding -- otherwise
    greedy decoding just repeats the last prompt token forever.
    """
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") else ""
    if leaf == "weight" and len(shape) == 1 and "norm" in parent:
        # Gemma's RMSNorm computes x * (1 + w); the others x * w. The mlx-lm
        # sanitize() "+1" norm shift for qwen3_next / qwen3_5 only applies to
        # HF-layout checkpoints, so these (mlx-layout) files store 1.0 directly.
        value = 0.0 if model_type == "gemma3_text" else 1.0
        return np.full(shape, value, dtype=np.float32)
    if leaf == "bias":
        return np.zeros(shape, dtype=np.float32)
    if leaf == "dt_bias":
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])
    if leaf == "A_log":
        return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    if "embed_tokens" in name:
        std = EMBED_STD
    elif "conv1d" in name:
        # depthwise Conv1d weight, mlx layout (channels, kernel, 1)
        std = (shape[1] * shape[2]) ** -0.5
    else:
        # Linear (out, in) or stacked experts (n_experts, out, in)
        std = shape[-1] ** -0.5
    return (rng.standard_normal(size=shape) * std).astype(np.float32)


def build_weights(name: str, spec: Dict[str, Any]) -> Dict[str, mx.array]:
    # Deep copy: some ModelArgs.__post_init__ mutate nested dicts in place
    # (qwen3_5 renames rope_parameters["rope_type"] to "type").
    config = copy.deepcopy(spec["config"])
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    dtype = getattr(mx, spec["dtype"])
    weights = {}
    params = cast(List[Tuple[str, Any]], tree_flatten(model.parameters()))
    for key, param in sorted(params, key=lambda kv: kv[0]):
        if key in spec.get("drop", ()):
            continue
        value = init_tensor(config["model_type"], key, param.shape, spec["seed"])
        if key.endswith("A_log"):
            # mlx-lm keeps A_log in float32 (see qwen3_5 cast_predicate).
            weights[key] = mx.array(value)
        else:
            weights[key] = mx.array(value).astype(dtype)
    mx.eval(weights)
    return weights


def write_model(out_dir: Path, name: str, spec: Dict[str, Any], tok_files: Dict[str, str]) -> Path:
    model_dir = out_dir / name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)

    config = dict(spec["config"])
    config["torch_dtype"] = spec["dtype"]
    (model_dir / "config.json").write_text(dumps(config), encoding="utf-8")
    for fname, text in tok_files.items():
        (model_dir / fname).write_text(text, encoding="utf-8")

    weights = build_weights(name, spec)
    mx.save_safetensors(
        str(model_dir / "model.safetensors"),
        dict(sorted(weights.items())),
        metadata={"format": "mlx"},
    )
    return model_dir
