"""The tiny models the serving tests run, built locally (nothing is downloaded): native
models trained one step and written by ``attnres export``, upcycled family models written by
``attnres.upcycle``; all with the byte tokenizer, random weights (non-zero pseudo-queries, so
the depth attention is not a uniform average) and head size 32 (vLLM's CPU attention takes
32, 64, ...)."""

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
SHAPE = dict(vocab_size=256, d_model=64, n_layers=3, n_heads=2, n_kv_heads=1, max_seq_len=256)


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


def export_native(out: Path, residual: dict, seed: int = 0) -> Path:
    """Train a native model one step (``attnres train``), give it random weights, save the
    checkpoint and ``attnres export`` it to ``out``."""
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
    train(load_config(None, overrides(corpus, work / "run", steps=1, eval_every=100, diagnostics_every=100,
                                      **model_fields)))
    loaded = load_run(work / "run")
    _randomize(loaded.model, seed)
    keep = {k: v for k, v in loaded.state.items() if k not in ("format_version", "step", "files", "optimizer")}
    save_checkpoint(work / "run", 2, loaded.model, torch.optim.AdamW(loaded.model.parameters()), keep, keep=5)
    cli_main(["export", "--checkpoint", str(work / "run"), "--out", str(out)])
    return out


def save_upcycled(out: Path, family: str, extra: dict, seed: int = 0) -> Path:
    """A random ``family`` model upcycled to Block AttnRes (S = 4 of L = 6: ragged) and saved
    with ``save_pretrained`` and the byte tokenizer, as ``attnres upcycle`` writes it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import make_hf_tokenizer
    from attnres.upcycle import upcycle

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        family, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    up = upcycle(AutoModelForCausalLM.from_config(config), "attnres_block", block_size=4)
    _randomize(up, seed)
    up.save_pretrained(out)
    make_hf_tokenizer(ByteTokenizer(), 256).save_pretrained(out)
    return out


def build_all(root: Path) -> dict[str, Path]:
    """Every test model under ``root``: name -> directory."""
    dirs = {name: export_native(root / name, residual) for name, residual in NATIVE.items()}
    dirs.update({name: save_upcycled(root / name, family, extra) for name, (family, extra) in UPCYCLED.items()})
    return dirs


def bad_directories(root: Path) -> dict[str, Path]:
    """Directories vLLM must refuse at load time, with a message naming the file or limit:
    ``mismatch`` - an export whose config.json says 2 layers over weights of 3;
    ``head_size`` - a native model with head size 16 (d_model 64 / 4 heads);
    ``moe`` - an upcycled Qwen3-MoE, a family the plugin does not serve yet."""
    import json

    from attnres import AttnResLM, ModelConfig
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import AttnResForCausalLM, make_hf_tokenizer

    out = {}
    for name, shape in (("mismatch", SHAPE), ("head_size", dict(SHAPE, n_heads=4, n_kv_heads=2))):
        directory = root / name
        model = AttnResLM(ModelConfig(**shape, residual={"kind": "attnres_block", "block_size": 2}))
        AttnResForCausalLM.from_native(model, eos_token_id=None).save_pretrained(directory)
        make_hf_tokenizer(ByteTokenizer(), 256).save_pretrained(directory)
        out[name] = directory
    config = json.loads((root / "mismatch" / "config.json").read_text())
    (root / "mismatch" / "config.json").write_text(json.dumps(dict(config, n_layers=2)))
    from attnres.models.families.tiny import tiny_model
    from attnres.upcycle import upcycle

    out["moe"] = root / "moe"
    upcycle(tiny_model("qwen3_moe", vocab_size=256), "attnres_block", block_size=2).save_pretrained(out["moe"])
    make_hf_tokenizer(ByteTokenizer(), 256).save_pretrained(out["moe"])
    return out
