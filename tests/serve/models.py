"""The tiny models the serving tests run, built locally (nothing is downloaded): native
models trained one step and written by ``attnres export``, upcycled family models written by
``attnres.upcycle``; all with the byte tokenizer, random weights (non-zero pseudo-queries, so
the depth attention is not a uniform average) and head size 32 (vLLM's CPU attention takes
32, 64, ...). The text model (:func:`text_weights`) writes text with line breaks and other
special-looking bytes, as a trained model does."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

#: name -> residual of the native models (L = 6 sublayers: S = 4 leaves a ragged last block).
NATIVE = {
    "standard": {"kind": "standard"},
    "block2": {"kind": "attnres_block", "block_size": 2},
    "block4_ragged": {"kind": "attnres_block", "block_size": 4},
    "full": {"kind": "attnres_full"},
}
#: name -> residual of the native models with a baseline residual whose stream cannot be cut into
#: pipeline stages (no ``history_layout``): mHC's several streams, DenseFormer's weighted averages.
BASELINES = {
    "mhc": {"kind": "mhc"},
    "denseformer": {"kind": "denseformer"},
}
#: The same for an upcycled model: name -> (transformers family, residual).
UPCYCLED_BASELINES = {"llama-mhc": ("llama", {"kind": "mhc"})}
#: name -> (transformers family, extra config): Llama, and Gemma 3 (sandwich norms, QK norms,
#: sliding-window layers).
UPCYCLED = {
    "llama": ("llama", {}),
    "gemma3": ("gemma3_text", {"sliding_window": 16,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
}
#: The other served families, in the slow suite (an engine start each): name -> (family, extra config).
OTHER_FAMILIES = {
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {"sliding_window": 16}),
}
#: The upcycled mixtures of experts: name -> (family, residual, changes to attnres's tiny model of
#: the family). Head size 32 (vLLM's CPU attention), MoE intermediate sizes its CPU experts
#: kernel takes; DeepSeek's attention in vLLM's multi-head form (docs/serving.md); GPT-OSS's
#: YaRN scaled to the context. Block S = 4 of L = 6 is ragged. One per required family in the
#: default suite (MOE); each with the other residual, and the further families, in the slow suite.
_MOE_SHAPE = dict(vocab_size=256, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  max_position_embeddings=256)
_MLA = dict(kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=2, head_dim=16)
_MOE_CHANGES = {
    "qwen3_moe": {},
    "mixtral": {},
    "olmoe": {},
    "deepseek_v3": _MLA,
    "gpt_oss": dict(intermediate_size=64, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}),
    "qwen2_moe": {},
    "deepseek_v2": _MLA,
    "glm4_moe": {},
    "granitemoe": {},
}
_BLOCK, _FULL = {"kind": "attnres_block", "block_size": 4}, {"kind": "attnres_full"}
MOE = {
    "qwen3_moe-block": ("qwen3_moe", _BLOCK),
    "mixtral-full": ("mixtral", _FULL),
    "olmoe-block": ("olmoe", _BLOCK),
    "deepseek_v3-full": ("deepseek_v3", _FULL),
    "gpt_oss-block": ("gpt_oss", _BLOCK),
}
MOE_SLOW = {f"{family}-{kind}": (family, residual) for family in _MOE_CHANGES
            for kind, residual in (("block", _BLOCK), ("full", _FULL)) if f"{family}-{kind}" not in MOE}


def save_upcycled_moe(out: Path, family: str, residual: dict, seed: int = 0) -> Path:
    """attnres's tiny random model of the mixture-of-experts ``family`` (its experts, routers,
    shared experts and dense layers; :data:`_MOE_CHANGES`), upcycled to ``residual`` with
    random weights and saved with the byte tokenizer, as ``attnres upcycle`` writes it."""
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import make_hf_tokenizer
    from fixtures.tiny_families import tiny_model
    from attnres.upcycle import upcycle

    up = upcycle(tiny_model(family, seed=seed, **{**_MOE_SHAPE, **_MOE_CHANGES[family]}), dict(residual))
    _randomize(up, seed)
    up.save_pretrained(out)
    make_hf_tokenizer(ByteTokenizer(), 256).save_pretrained(out)
    return out


#: An upcycled family the plugin does not serve (vLLM has no class of it): its refusal is tested.
UNSERVED_MOE = "dots1"
SHAPE = dict(vocab_size=256, d_model=64, n_layers=3, n_heads=2, n_kv_heads=1, max_seq_len=256)

#: The text model's cycle of bytes (all distinct): each byte of it is followed by the next, any
#: other byte by the first. Line break, tab, carriage return, the text "<s>" and U+010A "Ċ" (the
#: stand-in of byte-level BPE for the line break, two bytes in UTF-8): what a tokenizer that
#: declares ordinary tokens special loses, or encodes wrongly.
TEXT_CYCLE = "hey\n<s>\tĊ|\r ok".encode()
#: The text model: exported Block AttnRes with a ragged last block (S = 4 of L = 6).
TEXT_MODEL, TEXT_RESIDUAL = "text", {"kind": "attnres_block", "block_size": 4}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that greedy decoding is far from ties; queries and gains random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name:  # gains (Gemma's norms scale by 1 + weight: any value will do)
                p.copy_(torch.rand(p.shape, generator=gen) * 0.5 + 0.75)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def text_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights with which greedy decoding follows :data:`TEXT_CYCLE` from any prompt (margins
    of about 7 logits): orthonormal embeddings of the cycle's bytes (the other bytes share one
    direction), an LM head mapping each to its successor, and small random sublayers and
    pseudo-queries (non-zero; the depth mixing stays soft, so the embedding carries through)."""
    assert len(set(TEXT_CYCLE)) == len(TEXT_CYCLE)
    gen = torch.Generator().manual_seed(seed)
    d = model.config.d_model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) * 0.5 + 0.75)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.005)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        directions = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].T.float()
        other = directions[len(TEXT_CYCLE)]
        embedding = other * 8 + torch.randn(model.config.vocab_size, d, generator=gen) * 0.5
        head = torch.zeros(model.config.vocab_size, d)
        head[TEXT_CYCLE[0]] += 3 * other
        for i, byte in enumerate(TEXT_CYCLE):
            embedding[byte] = directions[i] * 8
            head[TEXT_CYCLE[(i + 1) % len(TEXT_CYCLE)]] += 3 * directions[i]
        model.embed_tokens.weight.copy_(embedding)
        model.lm_head.weight.copy_(head)


def export_native(out: Path, residual: dict, seed: int = 0, weights=_randomize) -> Path:
    """Train a native model one step (``attnres train``), give it ``weights(model, seed)``
    (random ones by default), save the checkpoint and ``attnres export`` it to ``out``."""
    tests = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(tests))
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.inference.loading import load_run
    from attnres.train import load_config, train
    from attnres.checkpoint import save_checkpoint

    work = out.parent / f"{out.name}-run"
    work.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(work / "corpus.txt", n_lines=50)
    model_fields = {f"model.{k}": v for k, v in SHAPE.items()}
    model_fields["model.residual"] = "{" + ", ".join(f"{k}: {v}" for k, v in residual.items()) + "}"
    train(load_config(None, overrides(corpus, work / "run", steps=1, warmup_steps=0, eval_every=100,
                                      diagnostics_every=100, **model_fields)))
    loaded = load_run(work / "run")
    weights(loaded.model, seed)
    keep = {k: v for k, v in loaded.state.items() if k not in ("format_version", "step", "files", "optimizer")}
    save_checkpoint(work / "run", 2, loaded.model, torch.optim.AdamW(loaded.model.parameters()), keep, keep=5)
    cli_main(["export", "--checkpoint", str(work / "run"), "--out", str(out)])
    return out


def save_upcycled(out: Path, family: str, extra: dict, seed: int = 0, residual: dict | None = None) -> Path:
    """A random ``family`` model upcycled to ``residual`` (default Block AttnRes, S = 4 of L = 6:
    ragged) and saved with ``save_pretrained`` and the byte tokenizer, as ``attnres upcycle``
    writes it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import make_hf_tokenizer
    from attnres.upcycle import upcycle

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        family, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    up = upcycle(AutoModelForCausalLM.from_config(config), dict(residual or {"kind": "attnres_block", "block_size": 4}))
    _randomize(up, seed)
    up.save_pretrained(out)
    make_hf_tokenizer(ByteTokenizer(), 256).save_pretrained(out)
    return out


def build_all(root: Path) -> dict[str, Path]:
    """Every test model under ``root``: name -> directory."""
    dirs = {name: export_native(root / name, residual) for name, residual in NATIVE.items()}
    dirs.update({name: save_upcycled(root / name, family, extra) for name, (family, extra) in UPCYCLED.items()})
    dirs[TEXT_MODEL] = export_native(root / TEXT_MODEL, TEXT_RESIDUAL, weights=text_weights)
    return dirs


def _edit_config(directory: Path, source: Path, change) -> Path:
    """A copy of ``source`` whose config.json ``change`` edited."""
    import json
    import shutil

    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _edit_weights(directory: Path, source: Path, change) -> Path:
    """A copy of ``source`` whose model.safetensors ``change`` (name -> tensor, in place) edited."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _drop_residual(tensors: dict, keep=lambda name: False) -> None:
    for name in [n for n in tensors if n.startswith("residual.") and not keep(n)]:
        del tensors[name]


def refusals(root: Path) -> dict[str, dict]:
    """What vLLM must refuse at load time, with a message naming the file, the field or the
    limit: name -> ``model`` (a directory) and extra ``engine`` arguments.

    ``mismatch`` - an export whose config.json says 2 layers over weights of 3;
    ``head_size`` - a native model with head size 16 (d_model 64 / 4 heads);
    ``moe`` - an upcycled mixture of experts of a family the plugin does not serve;
    ``old_tokenizer`` - an export whose tokenizer declares the line break its padding token
    (special), as attnres export did before;
    ``no_residual`` / ``upcycled_no_residual`` - configs without their residual settings;
    ``query_missing`` / ``upcycled_residual_missing`` - an export without one pseudo-query and
    an upcycled Llama without any of the residual's tensors (hand-edited checkpoints, which
    vLLM would serve at zero queries);
    ``extra_tensor`` - an export with a tensor the model has no place for;
    ``llama_model_type`` - an upcycled Llama whose model_type says "llama";
    ``other_tokenizer`` - an export served with ``tokenizer=`` another model's tokenizer, one
    token more than the export's vocabulary;
    ``quantized`` - an export whose config.json declares a quantization;
    ``classify_native`` / ``classify_upcycled`` - an export and an upcycled Llama served for
    sequence classification (vLLM's pooling runner, ``convert="classify"``)."""
    from transformers import PreTrainedTokenizerFast

    from attnres import AttnResLM, ModelConfig
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import AttnResForCausalLM, make_hf_tokenizer
    from attnres.hf.export import CHAT_TEMPLATE, byte_level_tokenizer
    from fixtures.tiny_families import tiny_model
    from attnres.upcycle import upcycle

    dirs = {}
    for name, shape in (("native", SHAPE), ("head_size", dict(SHAPE, n_heads=4, n_kv_heads=2))):
        dirs[name] = root / name
        model = AttnResLM(ModelConfig(**shape, residual={"kind": "attnres_block", "block_size": 2}))
        AttnResForCausalLM.from_native(model, eos_token_id=None).save_pretrained(dirs[name])
        make_hf_tokenizer(ByteTokenizer(), 256).save_pretrained(dirs[name])
    dirs["mismatch"] = _edit_config(root / "mismatch", dirs["native"], lambda c: c.update(n_layers=2))
    dirs["no_residual"] = _edit_config(root / "no_residual", dirs["native"], lambda c: c.pop("residual"))
    dirs["quantized"] = _edit_config(root / "quantized", dirs["native"], lambda c: c.update(
        quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"}))
    dirs["old_tokenizer"] = _edit_config(root / "old_tokenizer", dirs["native"], lambda c: None)
    rust = byte_level_tokenizer()  # what earlier versions of attnres export wrote: the line break pads
    PreTrainedTokenizerFast(tokenizer_object=rust, pad_token=rust.id_to_token(10), clean_up_tokenization_spaces=False,
                            chat_template=CHAT_TEMPLATE, model_max_length=256).save_pretrained(dirs["old_tokenizer"])
    rust = byte_level_tokenizer()
    rust.add_tokens(["<extra>"])  # id 256: past the export's embedding
    PreTrainedTokenizerFast(tokenizer_object=rust).save_pretrained(root / "larger_tokenizer")
    dirs["query_missing"] = _edit_weights(root / "query_missing", dirs["native"],
                                          lambda t: _drop_residual(t, keep=lambda n: n != "residual.mixers.1.query"))
    dirs["extra_tensor"] = _edit_weights(root / "extra_tensor", dirs["native"],
                                         lambda t: t.update({"residual.mixers.99.query": torch.zeros(SHAPE["d_model"])}))
    dirs["llama"] = save_upcycled(root / "llama", "llama", {})
    dirs["upcycled_residual_missing"] = _edit_weights(root / "upcycled_residual_missing", dirs["llama"], _drop_residual)
    dirs["upcycled_no_residual"] = _edit_config(root / "upcycled_no_residual", dirs["llama"],
                                                lambda c: c.pop("attnres_residual"))
    dirs["llama_model_type"] = _edit_config(root / "llama_model_type", dirs["llama"],
                                            lambda c: c.update(model_type="llama"))
    dirs["moe"] = root / "moe"
    upcycle(tiny_model(UNSERVED_MOE, vocab_size=256, max_position_embeddings=256), "attnres_block",
            block_size=2).save_pretrained(dirs["moe"])
    make_hf_tokenizer(ByteTokenizer(), 256).save_pretrained(dirs["moe"])
    out = {name: {"model": dirs[name]} for name in ("mismatch", "head_size", "moe", "old_tokenizer", "no_residual",
                                                    "upcycled_no_residual", "llama_model_type", "quantized", "query_missing",
                                                    "upcycled_residual_missing", "extra_tensor")}
    out["quantized"]["engine"] = {"dtype": "bfloat16"}  # vLLM's fp8 takes no float32
    out["other_tokenizer"] = {"model": dirs["native"], "engine": {"tokenizer": str(root / "larger_tokenizer")}}
    for name in ("native", "llama"):  # vLLM's sequence-classification adapter: a head no checkpoint holds
        out[f"classify_{'upcycled' if name == 'llama' else name}"] = {"model": dirs[name], "engine": {"runner": "pooling", "convert": "classify"}}
    return out


#: The LoRA adapter's target modules (attention and MLP of every layer: vLLM packs q/k/v and gate/up).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA = 8, 16


def save_lora_adapter(out: Path, base: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """A random LoRA adapter (PEFT's files: ``adapter_config.json``, ``adapter_model.safetensors``)
    for the upcycled or exported model in ``base``, large enough to change its greedy tokens; returns the
    weight deltas ``alpha / r * B @ A`` by the base model's parameter names."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            module = name.removesuffix(".weight")
            if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in LORA_TARGETS:
                continue
            out_dim, in_dim = f.get_slice(name).get_shape()
            a = torch.randn(LORA_RANK, in_dim, generator=gen) * 0.2
            b = torch.randn(out_dim, LORA_RANK, generator=gen) * 0.2
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
            deltas[name] = LORA_ALPHA / LORA_RANK * b @ a
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "base_model_name_or_path": str(base)}))
    return deltas


def save_eagle3_drafter(out: Path, target: Path, seed: int = 2) -> Path:
    """A random one-layer EAGLE-3 drafter (vLLM's ``LlamaForCausalLMEagle3`` layout) for the
    upcycled model in ``target``: it reads three of the target's auxiliary hidden states
    (``fc``: ``3 d -> d``). Its drafts are random; greedy speculative decoding keeps the
    target's tokens whatever they are."""
    import json

    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    d, heads, kv, head_dim = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], \
        config["head_dim"]
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    tensors = {
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * d),
        "midlayer.self_attn.k_proj.weight": rand(kv * head_dim, 2 * d),
        "midlayer.self_attn.v_proj.weight": rand(kv * head_dim, 2 * d),
        "midlayer.self_attn.o_proj.weight": rand(d, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, d),
        "midlayer.mlp.up_proj.weight": rand(inter, d),
        "midlayer.mlp.down_proj.weight": rand(d, inter),
        "midlayer.input_layernorm.weight": torch.ones(d),
        "midlayer.post_attention_layernorm.weight": torch.ones(d),
        "midlayer.hidden_norm.weight": torch.ones(d),
        "fc.weight": rand(d, 3 * d),
        "norm.weight": torch.ones(d),
        "lm_head.weight": rand(vocab, d),
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "num_hidden_layers": 1,
        "vocab_size": vocab, "draft_vocab_size": vocab, "target_hidden_size": d, "rms_norm_eps": 1e-6,
        "max_position_embeddings": config["max_position_embeddings"], "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32"}))
    return out
