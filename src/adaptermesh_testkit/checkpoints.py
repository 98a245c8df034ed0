"""Builders for tiny local checkpoints and PEFT-format adapters, for tests, demos and benches.

Nothing here downloads anything, and nothing needs ``peft`` at run time: adapters are written
directly in PEFT's on-disk format (``adapter_config.json`` + ``adapter_model.safetensors``), so
``peft.PeftModel.from_pretrained`` loads them unchanged. Their ``adapter_config.json`` and an
expert set's ``adaptermesh_adafuse.json`` come from the writers AdaFuse training publishes with
(:func:`adaptermesh.worker.adafuse_train.peft_adapter_config`, ``expert_set_meta``).

Public API::

    make_tiny_model(dir, arch="llama", *, seed=0, ...) -> Path
        A random Llama/Mistral/Qwen2 checkpoint with a local byte-level BPE tokenizer and a chat
        template in ``tokenizer_config.json``.
    make_adapter(dir, base_dir, name, rank, target_modules, seed, use_rslora=False, ...) -> Path
        A LoRA adapter for the model in ``base_dir`` with random non-zero A and B, saved under
        ``dir/name``.
    make_adafuse_expert_set(dir, base_dir, name, num_experts, top_k, rank, target_modules, seed, ...) -> Path
        An AdaFuse expert set (router + ``num_experts`` PEFT experts) in the engine's on-disk
        format, saved under ``dir/name``.
    make_model_config(arch, ...) -> dict
        The ``config.json`` contents of a model of a given shape (benches use it for a
        Llama-2-7B-shaped model).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from adaptermesh.worker.adafuse_train import MODULE_PARENTS, expert_set_meta, peft_adapter_config

__all__ = [
    "ALL_TARGET_MODULES",
    "CHAT_TEMPLATE",
    "FIM_TOKENS",
    "TOOLS_CHAT_TEMPLATE",
    "make_adafuse_expert_set",
    "make_adapter",
    "make_model_config",
    "make_tiny_model",
    "make_tokenizer",
    "set_chat_template",
]

Arch = Literal["llama", "mistral", "qwen2"]

ALL_TARGET_MODULES: tuple[str, ...] = tuple(MODULE_PARENTS)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A chat template that renders tools, an assistant's tool calls and tool results the way
# Qwen2.5's does (the hermes format: <tool_call> blocks), for tool-calling tests.
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}<|assistant|>\n"
    "{% for call in message['tool_calls'] %}<tool_call>\n"
    '{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% elif message['role'] == 'tool' %}<|user|>\n<tool_response>\n{{ message['content'] }}"
    "\n</tool_response>{{ eos_token }}\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def set_chat_template(model_dir: str | Path, template: str) -> None:
    """Replace the chat template in a checkpoint's ``tokenizer_config.json``."""
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))


# A small fixed corpus so the tokenizer (and therefore every tiny model) is deterministic.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Adapters let one base model serve many fine-tuned tasks at once.",
    "A service mesh steers each request to the shard that holds its adapter.",
    "Hello world! How are you today? I am fine, thank you.",
    "Low-rank adaptation adds a product of two thin matrices to a frozen weight.",
    "Once upon a time there was a small model that learned to count: one two three four five.",
    "def add(a, b):\n    return a + b\n",
    "user assistant system: answer the question briefly and politely.",
    "GPU workers batch requests for different adapters into one kernel launch.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols + - * / = < > ( ) [ ] { }",
]


# StarCoder's fill-in-the-middle tokens, for a tokenizer made with ``fim_tokens=True``.
FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def make_tokenizer(
    directory: str | Path, *, vocab_size: int = 384, fim_tokens: bool = False
) -> int:
    """Train a byte-level BPE tokenizer on a fixed corpus and save it with a chat template.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.
    Every byte sequence is encodable. ``fim_tokens``: the vocabulary also holds the special
    tokens of FIM_TOKENS. Returns the tokenizer's vocabulary size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    if fim_tokens:
        specials += FIM_TOKENS
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    # The BOS token goes in front of every encoded prompt, as Llama's tokenizer does.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    specials_map = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
    }
    (out / "special_tokens_map.json").write_text(json.dumps(specials_map, indent=2))
    return int(tok.get_vocab_size())


def make_model_config(
    arch: Arch = "llama",
    *,
    vocab_size: int = 384,
    hidden_size: int = 64,
    intermediate_size: int = 112,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 256,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    bos_token_id: int = 0,
    eos_token_id: int = 1,
) -> dict[str, Any]:
    """``config.json`` contents for a model of this shape, in the Hugging Face layout."""
    model_type = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}[arch]
    arch_name = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }[arch]
    cfg: dict[str, Any] = {
        "architectures": [arch_name],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    if arch == "mistral":
        cfg["sliding_window"] = None
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def make_tiny_model(
    directory: str | Path,
    arch: Arch = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 112,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 256,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    init_std: float = 0.08,
    fim_tokens: bool = False,
) -> Path:
    """Build a random checkpoint of the Llama family, with a tokenizer, in ``directory``.

    The weights are drawn with ``init_std`` (larger than the usual 0.02) so the logits are spread
    out and greedy decoding has no near-ties. Uses ``transformers`` to build and save the model,
    so the checkpoint is exactly what ``AutoModelForCausalLM.from_pretrained`` expects.
    Returns ``directory`` as a Path.
    """
    import transformers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out, fim_tokens=fim_tokens)
    cfg = make_model_config(
        arch,
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
    )
    cfg.pop("architectures")
    model_type = cfg.pop("model_type")
    cfg.pop("torch_dtype")
    config = transformers.AutoConfig.for_model(model_type, **cfg, initializer_range=init_std)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                # Norm gains near one keep activations in range while still being non-trivial.
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    return out


def _module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each targetable linear module."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def make_adapter(
    directory: str | Path,
    base_dir: str | Path,
    name: str,
    rank: int,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    seed: int = 0,
    use_rslora: bool = False,
    *,
    lora_alpha: float | None = None,
    scale_a: float | None = None,
    scale_b: float = 0.05,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a PEFT LoRA adapter for the model in ``base_dir`` to ``directory/name``.

    A and B are random and non-zero (PEFT initialises B to zero, which would make the adapter a
    no-op and every equivalence test vacuous). ``lora_alpha`` defaults to ``2 * rank``.
    Returns the adapter directory.
    """
    if rank < 1:
        raise ValueError(f"rank: must be >= 1, got {rank}")
    config = json.loads((Path(base_dir) / "config.json").read_text())
    shapes = _module_shapes(config)
    unknown = [m for m in target_modules if m not in shapes]
    if unknown:
        raise ValueError(f"target_modules: unknown modules {unknown}")
    alpha = float(2 * rank if lora_alpha is None else lora_alpha)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in target_modules:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{MODULE_PARENTS[module]}.{module}"
            sa = scale_a if scale_a is not None else 1.0 / math.sqrt(fan_in)
            tensors[f"{prefix}.lora_A.weight"] = (sa * torch.randn(rank, fan_in, generator=gen)).to(
                dtype
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                scale_b * torch.randn(fan_out, rank, generator=gen)
            ).to(dtype)
    out = Path(directory) / name
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = peft_adapter_config(Path(base_dir), rank, alpha, target_modules, use_rslora)
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out


def make_adafuse_expert_set(
    directory: str | Path,
    base_dir: str | Path,
    name: str,
    num_experts: int = 4,
    top_k: int = 2,
    rank: int = 4,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    seed: int = 0,
    use_rslora: bool = False,
    *,
    lora_alpha: float | None = None,
    router_bias: bool = True,
    router_std: float = 1.0,
    scale_b: float = 0.05,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write an AdaFuse expert set for the model in ``base_dir`` to ``directory/name``.

    Layout (see ``adaptermesh.worker.adafuse``): ``adaptermesh_adafuse.json``,
    ``router.safetensors`` (``weight`` [E, hidden], ``bias`` [E]) and ``experts/<i>/`` PEFT
    adapters with random non-zero weights. ``router_std`` scales the router weight so that
    different tokens pick different experts. Returns the set's directory.
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: must be in [1, num_experts={num_experts}], got {top_k}")
    config = json.loads((Path(base_dir) / "config.json").read_text())
    hidden = int(config["hidden_size"])
    alpha = float(2 * rank if lora_alpha is None else lora_alpha)
    out = Path(directory) / name
    for i in range(num_experts):
        make_adapter(
            out / "experts",
            base_dir,
            str(i),
            rank,
            target_modules,
            seed * 1000 + i + 1,
            use_rslora,
            lora_alpha=alpha,
            scale_b=scale_b,
            dtype=dtype,
        )
    gen = torch.Generator().manual_seed(seed)
    router = {"weight": (router_std * torch.randn(num_experts, hidden, generator=gen)).to(dtype)}
    if router_bias:
        router["bias"] = (0.1 * torch.randn(num_experts, generator=gen)).to(dtype)
    save_file(router, str(out / "router.safetensors"), metadata={"format": "pt"})
    meta = expert_set_meta(
        num_experts, top_k, hidden, router_bias, target_modules, rank, alpha, use_rslora
    )
    (out / "adaptermesh_adafuse.json").write_text(json.dumps(meta, indent=2))
    return out
