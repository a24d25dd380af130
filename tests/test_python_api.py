"""The Python API as a notebook uses it: what a user passes by mistake to ``AttnResLM``, its
forward, the inference functions and the ``attnres.nn`` building blocks is refused at the
boundary, in one message naming the argument and what it takes, instead of deep inside torch."""

from __future__ import annotations

import importlib
import inspect
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import make_model, twin_with_schedule
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from attnres import AttnResLM, ModelConfig
from attnres.nn import Attention, RotaryEmbedding, SwiGLU


def tiny_model(**changes) -> AttnResLM:
    torch.manual_seed(0)
    return AttnResLM(ModelConfig.preset("tiny", **changes)).eval()


@pytest.mark.parametrize("config", [{"vocab_size": 256}, "tiny", None])
@pytest.mark.parametrize("build", ["AttnResLM", "build_model"])
def test_the_model_takes_a_model_config_and_says_how_to_make_one(config, build):
    """``AttnResLM({"vocab_size": 256})`` or ``AttnResLM("tiny")`` ended in "'dict' object has
    no attribute 'validate'", ``build_model("tiny")`` in "'str' object has no attribute
    'hf_architecture'"."""
    from attnres.models import build_model

    with pytest.raises(TypeError, match=rf"^{build} takes a ModelConfig, got {type(config).__name__}: .*"
                                        r"ModelConfig.preset\(name\)"):
        {"AttnResLM": AttnResLM, "build_model": build_model}[build](config)


def test_ids_labels_and_mask_on_another_device_than_the_model_are_refused_by_name():
    """Token ids on the meta device with a CPU model gave logits of uninitialised memory
    without a word (the embedding of meta indices reads nothing); a CUDA model with CPU ids
    failed inside the embedding with torch's "Expected all tensors to be on the same device".
    The forward names the argument and the device to move it to, as ``generate`` does."""
    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    meta = ids.to("meta")
    with pytest.raises(ValueError, match=r"^input_ids is on meta, the model on cpu: .*input_ids.to\('cpu'\)"):
        model(meta)
    with pytest.raises(ValueError, match=r"^labels is on meta, the model on cpu: .*labels.to\('cpu'\)"):
        model(ids, labels=meta)
    with pytest.raises(ValueError, match=r"^attention_mask is on meta, the model on cpu"):
        model(ids, attention_mask=torch.ones(2, 8, device="meta"))
    with torch.device("meta"):
        on_meta = AttnResLM(ModelConfig.preset("tiny"))
    for inputs in (meta, ids):  # (shape inference, or weights accelerate offloads: computed where they are loaded)
        assert on_meta(inputs).logits.shape == (2, 8, 256)


@pytest.mark.parametrize("labels, match", [
    (lambda ids: ids.float(), r"^labels must be a tensor of token ids \(torch.long or torch.int32, -100 = ignored\), "
                              r"got dtype torch.float32$"),
    (lambda ids: ids.tolist(), r"^labels must be a tensor of token ids .*got list$"),
])
def test_labels_that_are_not_token_ids_are_refused_by_name(labels, match):
    """Float labels stopped in cross-entropy with "expected target dtype to be Long or Byte,
    but got Float"; a list of ids with "'list' object has no attribute 'shape'"."""
    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    with pytest.raises(ValueError, match=match):
        model(ids, labels=labels(ids))


@pytest.mark.parametrize("bad", [256, 1000, -1, -99, -101])
def test_labels_outside_the_vocabulary_are_refused_by_name(bad):
    """A label id past the vocabulary, or negative other than -100, stopped in cross-entropy
    with "Target 256 is out of bounds" (a device-side assert on CUDA); it is refused naming
    ``labels`` and the ids it takes. -100 is ignored as before (read on the CPU only: on an
    accelerator the values are not read, which would wait for the device)."""
    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    labels = ids.clone()
    labels[1, 3] = bad
    with pytest.raises(ValueError, match=rf"^labels must be token ids in \[0, 256\) or -100 \(ignored\); got {bad}$"):
        model(ids, labels=labels)
    labels[1, 3] = -100  # ignored
    assert torch.isfinite(model(ids, labels=labels).loss)


@pytest.mark.parametrize("bad", [2.0, -float("inf"), 0.5, -1.0])
def test_an_attention_mask_of_values_other_than_0_and_1_is_refused_by_name(bad):
    """A mask value other than 0 and 1 was read as 1 without a word: an additive mask (0 for a
    token, -inf for padding) masked the tokens and kept the padding, a 2 or 0.5 counted as a
    real token. Refused naming ``attention_mask`` and the values it takes (on the CPU); a
    mask of 0/1 in any dtype gives the logits of the boolean mask."""
    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    mask = torch.ones(2, 8)
    mask[0, :3] = 0
    mask[1, 5] = bad
    with pytest.raises(ValueError, match=rf"^attention_mask must hold only 0 \(padding\) and 1 \(a real token\); got "
                                         rf"{re.escape(str(bad))} \(an additive mask"):
        model(ids, attention_mask=mask)
    mask[1, 5] = 1
    expected = model(ids, attention_mask=mask.bool()).logits
    for dtype in (torch.float32, torch.long, torch.int32):
        assert torch.equal(model(ids, attention_mask=mask.to(dtype)).logits, expected)


def test_labels_and_a_mask_on_fake_tensors_are_not_read():
    """The value checks of labels and masks read the values (boolean indexing) on the CPU:
    under ``FakeTensorMode`` (shapes without storage, as the GPU check's launch survey runs a
    model) that indexing has no shape to give ("DynamicOutputShapeException: aten.nonzero").
    Fake tensors are not read; the forward gives its shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = tiny_model()
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.randint(0, 256, (2, 8))
        out = model(ids, labels=ids.clone(), attention_mask=torch.ones(2, 8, dtype=torch.long))
        assert out.logits.shape == (2, 8, 256) and out.loss.shape == ()


def test_the_loaders_given_a_model_where_the_path_goes_name_the_order(tmp_path):
    """``load_checkpoint(model, path)`` and ``load_run(model)`` ended in pathlib's "expected
    str, bytes or os.PathLike object, not AttnResLM", ``load_checkpoint(path, state_dict)`` deep in
    the load; each names the argument and
    the order the function takes."""
    from attnres.checkpoint import load_checkpoint
    from attnres.inference import load_run

    model = tiny_model()
    with pytest.raises(TypeError, match=r"^path must be a checkpoint directory \(step-\*\) \(a str or Path\), got "
                                        r"AttnResLM: call it as load_checkpoint\(path, model, optimizer=None, \.\.\.\)$"):
        load_checkpoint(model, tmp_path)
    with pytest.raises(TypeError, match=r"^path must be a checkpoint or run directory \(a str or Path\), got AttnResLM: "
                                        r"call it as load_run\(path, device='cpu'\)$"):
        load_run(model)
    with pytest.raises(TypeError, match=r"^load_checkpoint: model must be the nn.Module to load into, got OrderedDict$"):
        load_checkpoint(tmp_path, model.state_dict())


def test_load_checkpoint_of_a_run_directory_names_its_newest_checkpoint(tmp_path):
    """``load_checkpoint("runs/my-run", model)`` - a run directory, as ``load_run`` takes - was
    told "checkpoint 'runs/my-run' is incomplete: state.json is missing", as if the run were
    damaged. It is told the directory is a run's, its newest checkpoint, and ``load_run``; a
    directory that is neither is still incomplete."""
    from test_train import write_corpus

    from attnres.checkpoint import CheckpointError, load_checkpoint
    from attnres.checkpoint.manifest import checkpoint_dirs
    from attnres.cli import main as cli_main

    run = tmp_path / "run"
    assert cli_main(["train", "model=tiny", "data.tokenizer=byte", f"data.paths=[{write_corpus(tmp_path / 'c.txt')}]",
                     "seq_len=16", "batch_size=2", "steps=2", "warmup_steps=1", "checkpoint_every=1",
                     "keep_checkpoints=2", f"out_dir={run}", "progress=false", "tensorboard=false"]) == 0
    newest = checkpoint_dirs(run)[-1]
    with pytest.raises(CheckpointError, match=re.escape(
            f"{str(run)!r} is a run directory, not one of its checkpoints: give a checkpoint (its newest: "
            f"{str(newest)!r}); attnres.inference.load_run takes a run directory (its newest checkpoint that verifies)")):
        load_checkpoint(run, tiny_model())
    load_checkpoint(newest, tiny_model())
    with pytest.raises(CheckpointError, match="is incomplete: state.json is missing"):
        load_checkpoint(tmp_path, tiny_model())


def test_load_tokenizer_of_the_model_says_to_pass_the_run():
    """``load_tokenizer(run.model)`` - the model where the run goes - ended in pathlib's
    "expected str, bytes or os.PathLike object, not AttnResLM"."""
    from attnres.inference import load_tokenizer

    with pytest.raises(TypeError, match=r"^load_tokenizer takes the LoadedRun that load_run\(path\) gives, or a "
                                        r"checkpoint or run directory; got AttnResLM: pass the run, load_tokenizer\(run\), "
                                        r"not run.model$"):
        load_tokenizer(tiny_model())
    with pytest.raises(TypeError, match=r"^load_tokenizer takes .*; got int$"):
        load_tokenizer(3)


def test_int32_labels_give_the_loss_of_int64_labels():
    """int32 ids are taken as token ids, so ``model(ids, labels=ids)`` with them is the natural
    call; it stopped in cross-entropy ("expected target dtype to be Long or Byte, but got Int")."""
    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    expected = model(ids, labels=ids).loss
    assert torch.equal(model(ids.int(), labels=ids.int()).loss, expected)


def test_an_attention_mask_that_is_not_a_tensor_is_refused_by_name():
    """A nested list as the mask ended in "'list' object has no attribute 'shape'"."""
    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    with pytest.raises(ValueError, match=r"^attention_mask must be a tensor of shape \[batch, past \+ seq_len\] = "
                                         r"\(2, 8\), got list$"):
        model(ids, attention_mask=[[1] * 8] * 2)


def test_generate_without_a_number_of_new_tokens_is_refused_by_name():
    """``generate(model, ids, max_new_tokens=None)`` (a notebook's "as many as you like")
    passed the check and ended in "unsupported operand type(s) for +: 'int' and 'NoneType'"."""
    from attnres.inference import generate, stream

    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    for call in (generate, stream):
        with pytest.raises(ValueError, match=r"^max_new_tokens must be an integer >= 1; got None$"):
            call(model, ids, max_new_tokens=None)


@pytest.mark.parametrize("logits, got", [(torch.randn(2, 3, 10), r"\(2, 3, 10\)"), (torch.randn(10), r"\(10,\)"),
                                         ([[0.5, 1.0]], "list")])
def test_sample_takes_one_row_of_logits_per_sequence_and_says_how_to_get_them(logits, got):
    """``sample(out.logits, temperature=0.8)`` with a forward's ``[B, T, vocab]`` stopped in
    ``torch.multinomial`` ("prob_dist must be 1 or 2 dim"); one row's ``[vocab]`` failed in the
    top-k filter ("too many indices for tensor of dimension 1"); a list, "'list' object has no
    attribute 'device'"."""
    from attnres.inference import sample

    with pytest.raises(ValueError, match=rf"^sample: logits must be a tensor \[batch, vocab\], got {got}: .*"
                                         r"out.logits\[:, -1\], one row \[vocab\] as logits\[None\]$"):
        sample(logits, temperature=0.8, top_k=5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_of_logits_over_no_token_is_refused_by_name(temperature):
    """Logits ``[batch, 0]`` (a head sliced to nothing) failed in argmax's "Expected reduction
    dim 1 to have non-zero size" (greedy) or deeper in the draw."""
    from attnres.inference import sample

    with pytest.raises(ValueError, match=r"^sample: logits must hold a logit for each token of the vocabulary, got "
                                         r"\(2, 0\): no token to pick$"):
        sample(torch.randn(2, 0), temperature=temperature)
    assert sample(torch.randn(0, 5), temperature=temperature).shape == (0,)  # (an empty batch: nothing to draw)


@pytest.mark.parametrize("args, match", [(("2",), r"n_layers must be an integer >= 1, got '2'"),
                                         ((0,), r"n_layers must be an integer >= 1, got 0"),
                                         ((2, -1), r"capacity must be an integer >= 0, got -1")])
def test_a_kv_cache_of_a_bad_size_is_refused_by_name(args, match):
    """``KVCache("2")`` failed with "'<' not supported between instances of 'str' and 'int'"."""
    from attnres.inference import KVCache

    with pytest.raises(ValueError, match=rf"^KVCache: {match}$"):
        KVCache(*args)


def test_attention_on_its_own_names_the_input_shape_it_takes():
    """``attnres.nn.Attention`` in a model of one's own: an unbatched ``[T, d]`` input failed
    with "not enough values to unpack (expected 3, got 2)", another width in a matmul ("mat1
    and mat2 shapes cannot be multiplied (10x12 and 16x16)"), RoPE tables of another length
    in a broadcast inside ``apply_rotary``."""
    attention, rope = Attention(16, 4, 2), RotaryEmbedding(4, 32)
    for x in (torch.randn(5, 16), torch.randn(2, 5, 12)):
        with pytest.raises(ValueError, match=rf"^Attention: x must have shape \[batch, seq_len, d_model=16\], got "
                                             rf"{re.escape(str(tuple(x.shape)))}$"):
            attention(x, *rope(5))
    with pytest.raises(ValueError, match=r"^Attention: cos and sin must have the 6 rows of x's positions .*got \(5, 4\)$"):
        attention(torch.randn(2, 6, 16), *rope(5))
    assert attention(torch.randn(2, 5, 16), *rope(5)).shape == (2, 5, 16)


@pytest.mark.parametrize("build, match", [
    (lambda: SwiGLU(8, 0), r"^SwiGLU: hidden must be an integer >= 1, got 0$"),
    (lambda: SwiGLU(-1, 4), r"^SwiGLU: d_model must be an integer >= 1"),
    (lambda: RotaryEmbedding(0, 8),
     r"^RotaryEmbedding: head_dim must be an integer >= 1, got 0$"),
    (lambda: RotaryEmbedding("4", 8),
     r"^RotaryEmbedding: head_dim must be an integer >= 1, got '4'$"),
    (lambda: RotaryEmbedding(4, 0),
     r"^RotaryEmbedding: max_seq_len must be an integer >= 1, got 0$"),
    (lambda: RotaryEmbedding(4, 8, theta=-1.0),
     r"^RotaryEmbedding: theta must be a finite number > 0, got -1.0$"),
])
def test_mlp_and_rope_of_sizes_they_cannot_have_are_refused_where_they_are_built(build, match):
    """``SwiGLU(8, 0)`` was built and returned zeros, ``SwiGLU(-1, 4)`` failed inside torch
    ("Trying to create tensor with negative dimension"); ``RotaryEmbedding`` with a head
    dimension or length of 0 built empty tables, with a negative ``theta`` tables of NaN,
    and with ``"4"`` failed in a string format ("not all arguments converted")."""
    with pytest.raises(ValueError, match=match):
        build()


PUBLIC_MODULES = ["attnres", "attnres.nn", "attnres.nn.residual", "attnres.ops", "attnres.models", "attnres.inference"]


def undocumented(module_name: str) -> list[str]:
    """The names of ``module_name.__all__`` that are missing, or are a class or function
    without a docstring, or a class whose public methods or properties have none (one inherited
    from the method it overrides counts: ``help()`` shows it)."""
    module = importlib.import_module(module_name)
    missing = []
    for name in module.__all__:
        if not hasattr(module, name):
            missing.append(f"{name} (in __all__, not in the module)")
            continue
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # (constants: documented by the comment above them)
        if not obj.__doc__:
            missing.append(name)
        if inspect.isclass(obj):
            missing += [f"{name}.{attr}" for attr, member in vars(obj).items()
                        if not attr.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
                        and not inspect.getdoc(getattr(obj, attr) if inspect.isfunction(member) else member)
                        and not _inherited_doc(obj, attr)]
    return missing


def _inherited_doc(cls: type, attr: str) -> bool:
    return any(getattr(getattr(base, attr, None), "__doc__", None) for base in cls.__mro__[1:])


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_has_a_docstring_that_help_shows(module_name):
    """``help(attnres.inference.StopStrings)`` and the like showed methods without a word
    (``AttnResLM.num_parameters``, ``ModelConfig.head_dim``, ``KVCache``'s, ``feed``, ...)."""
    assert undocumented(module_name) == []


def test_load_run_names_its_device_argument_not_the_command_line_option(tmp_path, monkeypatch):
    """``load_run(run, device="gpu")`` in a notebook was told "--device must be ...", an option
    it has not got, and ``device="cuda"`` without one to "use --device cpu"."""
    from attnres.inference import load_run

    with pytest.raises(ValueError, match=r"^device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got 'gpu' "
                                         r"\(did you mean 'cuda'\?\)$"):
        load_run(tmp_path, device="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device 'cuda': no CUDA device is available here \(.*\); use device='cpu'$"):
        load_run(tmp_path, device="cuda")


def test_a_kv_cache_that_is_not_one_is_refused_by_name():
    """``model(ids, kv_cache=cache_list)`` (or any other object) ended in "'list' object has no
    attribute 'seq_len'"."""
    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    with pytest.raises(ValueError, match=r"^kv_cache must be an attnres.inference.KVCache or StaticKVCache, got list: "
                                         r"make it for this model: KVCache\(model.config.n_layers\)"):
        model(ids, kv_cache=[])


def test_generate_shows_its_arguments_and_names_a_misspelt_one():
    """``help(generate)`` showed ``(model, input_ids, attention_mask=None, **kwargs)``, and a
    misspelt argument was "stream() got an unexpected keyword argument 'max_tokens'", a function
    the call did not name; transformers' ``eos_token_id`` would be matched to ``pad_token_id``."""
    from attnres.inference import generate, stream

    assert list(inspect.signature(generate).parameters) == list(inspect.signature(stream).parameters)
    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    for given, meant in (("max_tokens", "max_new_tokens"), ("eos_token_id", "stop_tokens")):
        with pytest.raises(TypeError, match=rf"^generate\(\) got unexpected keyword argument\(s\) \['{given}'\] \(did "
                                            rf"you mean '{meant}' for '{given}'\?\); it takes max_new_tokens, temperature"):
            generate(model, ids, max_new_tokens=2, **{given: 1})
    assert generate(model, ids, max_new_tokens=2).shape == (2, 2)


def test_labels_of_a_single_token_sequence_are_refused_instead_of_a_nan_loss():
    """``model(ids[:, :1], labels=ids[:, :1])`` gave ``loss = nan``: the mean over no predicted
    token (the labels are shifted by one inside)."""
    model, ids = tiny_model(), torch.randint(0, 256, (2, 1))
    with pytest.raises(ValueError, match=r"^labels need a sequence of at least 2 tokens: .*a sequence of 1 predicts "
                                         r"none \(the loss would be NaN\)$"):
        model(ids, labels=ids)
    assert model(ids).logits.shape == (2, 1, 256)  # (without labels, one token is a forward like any)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_function_that_takes_tensors_gives_their_shapes(module_name):
    """``help(attnres.models.run_sublayers)`` did not say what ``cos``, ``sin`` and
    ``attn_mask`` are ([T, head_dim], [B, 1, T, past + T])."""
    module = importlib.import_module(module_name)
    functions = [getattr(module, name) for name in module.__all__ if inspect.isfunction(getattr(module, name))]
    takes_tensors = [f for f in functions if "Tensor" in str(inspect.signature(f))]
    assert [f.__name__ for f in takes_tensors if "[" not in (f.__doc__ or "")] == []


@pytest.mark.parametrize("n", [0, -1, 2.0])
def test_a_static_decoder_asked_for_no_steps_says_so(n):
    """``StaticDecoder.decode(tokens, 0)`` ended in torch.stack's "stack expects a non-empty
    TensorList"; a negative ``n`` likewise."""
    from attnres.inference import StaticDecoder, prefill

    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    logits, cache = prefill(model, ids)
    decoder = StaticDecoder(model, batch_size=2, capacity=16, mode="eager")
    decoder.load(cache)
    with pytest.raises(ValueError, match=rf"^StaticDecoder.decode: n \(the steps to decode\) must be an integer >= 1, "
                                         rf"got {n!r}$"):
        decoder.decode(logits.argmax(-1), n)
    assert decoder.decode(logits.argmax(-1), 2).shape == (2, 2)


@pytest.mark.parametrize("labels, logits", [((2, 7), (2, 8, 10)), ((8,), (2, 8, 10)), ((2, 8), (8, 10))])
def test_next_token_loss_of_labels_not_of_the_logits_positions_is_refused_by_name(labels, logits):
    """``attnres.models.next_token_loss`` in one's own training loop, with labels the caller
    shifted already, failed in cross-entropy with "Expected input batch_size (14) to match
    target batch_size (12)"; 1-D labels with "too many indices for tensor of dimension 1"."""
    from attnres.models import next_token_loss

    with pytest.raises(ValueError, match=rf"^next_token_loss: labels must be \[batch, seq_len\] as logits are .*"
                                         rf"got labels {re.escape(str(labels))}, logits {re.escape(str(logits))}$"):
        next_token_loss(torch.randn(logits), torch.zeros(labels, dtype=torch.long))


def block_checkpoint(out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint of a Block AttnRes model (S=2 of 8 sublayers) as ``attnres train`` stores
    it (its model config in ``state.json``), written without training; and its weights."""
    from attnres.checkpoint import save_checkpoint

    model = tiny_model(n_layers=4, residual={"kind": "attnres_block", "block_size": 2})
    with torch.no_grad():  # (the pseudo-queries start at zero: weights another model could not have by chance)
        for p in model.parameters():
            p.normal_()
    state = {"config": {"model": model.config.to_dict()}}
    path = save_checkpoint(out, 1, model, torch.optim.AdamW(model.parameters()), state, keep=1)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("residual, said", [
    ({"kind": "attnres_block", "block_size": 4}, r"model.residual.block_size: 2 there, 4 here"),
    ({"kind": "attnres_full"}, r"model.residual.kind: 'attnres_block' there, 'attnres_full' here"),
])
@pytest.mark.parametrize("loader", ["load_checkpoint", "load_weights"])
def test_loading_a_checkpoint_into_a_model_of_another_residual_is_refused_naming_both(tmp_path, residual, said, loader):
    """``attnres.checkpoint.load_checkpoint(path, model)`` of a Block AttnRes S=2 run into a
    Block AttnRes S=4 or a Full AttnRes model (the same parameter names and shapes) loaded its
    weights without a word, where ``attnres train init_from=...`` refuses it: the model then
    computed something else from them. Refused, naming both residuals and the keyword that
    allows it; nothing is loaded."""
    from attnres.checkpoint import CheckpointError, load_checkpoint, load_weights, read_checkpoint_state

    path, _ = block_checkpoint(tmp_path / "run")
    model = tiny_model(n_layers=4, residual=residual)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"^checkpoint '.*step-00000001': this model's residual differs from the "
                                              rf"checkpoint's \({said}\); its weights would load into this model "
                                              rf"without a word .*allow_residual_change=True"):
        if loader == "load_checkpoint":
            load_checkpoint(path, model)
        else:
            load_weights(path, read_checkpoint_state(path), model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())



@pytest.mark.parametrize("loader", ["load_checkpoint", "load_weights"])
def test_a_checkpoint_whose_weights_do_not_fit_a_model_of_another_residual_says_which_residual(tmp_path, loader):
    """newuser13: a Block AttnRes checkpoint into a standard model (weights that do not fit)
    was refused with the residual's weights alone ("does not fit the model: missing [],
    unexpected ['residual.mixers.0.key_norm.weight', ...]"), not saying that the model was built
    with another residual than the checkpoint's, nor how to build that one. The refusal now
    names both residuals and the way out; a model of the checkpoint's residual but another
    width is refused as before, without it."""
    from attnres.checkpoint import CheckpointError, load_checkpoint, load_weights, read_checkpoint_state

    path, _ = block_checkpoint(tmp_path / "run")

    def load(model):
        if loader == "load_checkpoint":
            load_checkpoint(path, model)
        else:
            load_weights(path, read_checkpoint_state(path), model)

    with pytest.raises(CheckpointError, match=r"does not fit the model: missing \[\], unexpected \['residual.*\]\. The "
                                              r"checkpoint's model has another residual \(model.residual.kind: "
                                              r"'attnres_block' there, 'standard' here\): build the model with the "
                                              r"checkpoint's residual \(config.model.residual in its state.json\), or load "
                                              r"the checkpoint's own model with attnres.inference.load_run$"):
        load(tiny_model(n_layers=4, residual="standard"))
    with pytest.raises(CheckpointError) as refused:
        load(tiny_model(n_layers=4, d_model=32, residual={"kind": "attnres_block", "block_size": 2}))
    assert "another residual" not in str(refused.value)

def test_a_checkpoint_loads_into_its_own_residual_an_allowed_other_one_and_a_plain_module(tmp_path):
    """The refusal above asks only where the model tells its residual (an ``AttnResLM``) and it
    is another one: the same residual by another kernel loads, ``allow_residual_change=True``
    loads a Block AttnRes run into Full AttnRes (an upcycle meant), and a plain ``nn.Module``
    (nothing to compare) loads as before."""
    from attnres.checkpoint import load_checkpoint

    path, saved = block_checkpoint(tmp_path / "run")

    def loaded(model: torch.nn.Module, **kwargs) -> bool:
        load_checkpoint(path, model, restore_rng=False, **kwargs)
        return all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())

    assert loaded(tiny_model(n_layers=4, residual={"kind": "attnres_block", "block_size": 2, "backend": "torch"}))
    assert loaded(tiny_model(n_layers=4, residual="attnres_full"), allow_residual_change=True)
    plain = torch.nn.Module()  # a Full AttnRes model's modules, without its config
    for name, child in tiny_model(n_layers=4, residual="attnres_full").named_children():
        plain.add_module(name, child)
    assert loaded(plain)


# -- properties over the whole boundary (hypothesis) ---------------------------------------

_NOT_A_COUNT = st.one_of(st.integers(max_value=0), st.integers(1, 64).map(str),
                         st.floats(0.5, 64).filter(lambda x: x != int(x)), st.booleans(), st.just([2]))
_NOT_POSITIVE = st.one_of(st.floats(max_value=0.0), st.sampled_from([math.nan, math.inf, None, True]),
                          st.floats(0.1, 10).map(str))
#: Values each ModelConfig field refuses, by field (a count, a count or null, a positive number, a bool).
_INVALID_MODEL_FIELDS = {
    **{name: _NOT_A_COUNT | st.none() for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")},
    **{name: _NOT_A_COUNT for name in ("n_kv_heads", "mlp_hidden")},
    **{name: _NOT_POSITIVE for name in ("rope_theta", "norm_eps", "init_std")},
    "tie_embeddings": st.one_of(st.integers(), st.text(max_size=3), st.none()),
}
_INVALID_RESIDUAL_FIELDS = {
    "block_size": _NOT_A_COUNT,
    "eps": st.one_of(st.floats(max_value=-1e-9), st.just(math.nan), st.text(max_size=2)),
    "backend": st.text(max_size=6).filter(lambda s: s not in ("auto", "torch", "triton", "reference")),
    "schedule": st.text(max_size=6).filter(lambda s: s not in ("two_phase", "naive")),
}


def _field_and_value(invalid: dict) -> st.SearchStrategy:
    return st.sampled_from(sorted(invalid)).flatmap(lambda name: st.tuples(st.just(name), invalid[name]))


@settings(max_examples=examples(200))
@given(_field_and_value(_INVALID_MODEL_FIELDS), st.booleans())
def test_any_invalid_model_field_is_refused_naming_it(field_value, nested):
    """Whatever a notebook passes to a field - 0, a negative, a quoted number, a fraction, a
    bool, a list, NaN - the error starts with the field's full name (a residual field's too),
    whether set directly or through ``ModelConfig.preset``."""
    field, value = field_value
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    with pytest.raises(ValueError, match=rf"^ModelConfig\.{field} "):
        ModelConfig.preset("tiny", **{field: value}) if nested else ModelConfig(**{**base, field: value})


@settings(max_examples=examples(100))
@given(_field_and_value(_INVALID_RESIDUAL_FIELDS))
def test_any_invalid_residual_field_is_refused_naming_it(field_value):
    field, value = field_value
    with pytest.raises(ValueError, match=rf"^ModelConfig\.residual\.{field} "):
        ModelConfig.preset("tiny", residual={"kind": "attnres_block", field: value})


_SHAPE_MODELS: dict = {}


def _shape_model(residual: str):
    """The tiny model of ``residual`` with random pseudo-queries and its twin on the naive
    (per-sublayer reference) schedule, built once per test session."""
    from conftest import make_model, twin_with_schedule

    if residual not in _SHAPE_MODELS:
        model = make_model(residual=residual, max_seq_len=24).eval()
        _SHAPE_MODELS[residual] = (model, twin_with_schedule(model, "naive"))
    return _SHAPE_MODELS[residual]


@settings(max_examples=examples(30))
@given(st.sampled_from(["attnres_block", "attnres_full", "standard"]), st.integers(1, 3), st.integers(1, 24),
       st.integers(0, 2**16))
def test_any_valid_batch_and_length_match_the_reference_and_each_row_alone(residual, batch, length, seed):
    """Every ``[batch, seq_len]`` with ``1 <= seq_len <= max_seq_len``, int64 or int32: the
    two-phase schedule gives the naive reference's logits, and each row of the batch the
    logits it gets alone (up to float32 rounding)."""
    model, reference = _shape_model(residual)
    ids = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = model(ids).logits
        assert logits.shape == (batch, length, 256)
        torch.testing.assert_close(logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model(ids.int()).logits, logits, atol=0, rtol=0)
        for row in range(batch):
            torch.testing.assert_close(model(ids[row:row + 1]).logits[0], logits[row], atol=1e-4, rtol=1e-4)


@settings(max_examples=examples(40))
@given(st.integers(0, 3), st.integers(0, 40), st.sampled_from([torch.long, torch.int32, torch.float32, torch.int16]))
def test_any_invalid_batch_length_or_dtype_is_refused_naming_input_ids(batch, length, dtype):
    """An empty batch or sequence, one past ``max_seq_len`` or ids that are not int64/int32:
    a ``ValueError`` naming ``input_ids`` (or ``max_seq_len``) before any compute; the rest run."""
    model, _ = _shape_model("attnres_block")
    ids = torch.zeros(batch, length, dtype=dtype)
    valid = dtype in (torch.long, torch.int32) and batch >= 1 and 1 <= length <= 24
    if valid:
        assert model(ids).logits.shape == (batch, length, 256)
        return
    with pytest.raises(ValueError, match=r"^(input_ids must|sequence length \d+ exceeds ModelConfig.max_seq_len=24$)"):
        model(ids)


#: Values each sampling argument of generate refuses, by argument.
_INVALID_SAMPLING = {
    "max_new_tokens": _NOT_A_COUNT | st.none(),
    "temperature": st.one_of(st.floats(max_value=-1e-9), st.sampled_from([math.nan, math.inf, True, None, "0.8"])),
    "top_k": st.one_of(st.integers(max_value=-1), st.floats(0.5, 9).filter(lambda x: x != int(x)), st.just("5")),
    "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True), st.just(math.nan),
                       st.just("0.9")),
}


@settings(max_examples=examples(80))
@given(_field_and_value(_INVALID_SAMPLING))
def test_any_invalid_sampling_argument_of_generate_is_refused_naming_it(argument_value):
    """``max_new_tokens`` 0, negative or fractional, a negative or NaN ``temperature``, a
    ``top_p`` past 1, a quoted number: ``generate`` refuses each before any compute, with the
    argument's name first."""
    from attnres.inference import generate

    argument, value = argument_value
    model, _ = _shape_model("attnres_block")
    arguments = {"max_new_tokens": 2, "temperature": 0.8, argument: value}
    with pytest.raises(ValueError, match=rf"^{argument} must be "):
        generate(model, torch.zeros(1, 3, dtype=torch.long), **arguments)


def test_a_checkpoint_of_a_compiled_model_loads_into_the_model_and_back(tmp_path):
    """``save_checkpoint(out, step, torch.compile(model), ...)`` stored the weights under
    ``torch.compile``'s ``_orig_mod.`` prefix: ``load_run`` and ``load_checkpoint`` into the
    model refused the checkpoint ("does not fit the model: missing ['embed_tokens.weight', ...]"),
    and a checkpoint of the plain model did not load into its compiled one. Both sides save and
    load the compiled model's original, the names ``model.state_dict()`` gives."""
    from attnres.checkpoint import load_checkpoint, save_checkpoint
    from attnres.inference import load_run

    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    with torch.no_grad():  # (weights a fresh model does not have by chance)
        for p in model.parameters():
            p.normal_(0, 0.1)
    logits = model(ids).logits
    compiled = torch.compile(model)
    state = {"config": {"model": model.config.to_dict()}}
    path = save_checkpoint(tmp_path / "run", 1, compiled, torch.optim.AdamW(compiled.parameters()), state, keep=1)
    assert torch.equal(load_run(tmp_path / "run").model(ids).logits, logits)
    into = tiny_model()
    load_checkpoint(path, torch.compile(into), restore_rng=False)
    assert torch.equal(into(ids).logits, logits)


def test_an_optimiser_of_a_compiled_model_stores_its_parameters_own_names(tmp_path):
    """An optimiser built from ``torch.compile(model).named_parameters()`` names its
    parameters ``_orig_mod.<name>`` (its state dict's ``param_names``): ``save_checkpoint``
    stored them so, beside weights stored without it, and an optimiser of the plain model that
    loaded them took the compiled names (torch keeps the stored ones). They are stored as the
    weights are; the state itself is by position and loads either way."""
    import json

    from attnres.checkpoint import load_checkpoint, save_checkpoint

    model = tiny_model()
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(compiled.named_parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = {"config": {"model": model.config.to_dict()}}
    path = save_checkpoint(tmp_path / "run", 1, compiled, optimizer, state, keep=1)
    stored = json.loads((path / "state.json").read_text())["optimizer"]["param_groups"][0]["param_names"]
    own = [name for name, _ in model.named_parameters()]
    assert stored == own
    into = tiny_model()
    plain = torch.optim.AdamW(into.named_parameters())
    load_checkpoint(path, into, plain, restore_rng=False)
    assert list(plain.state_dict()["param_groups"][0]["param_names"]) == own
    assert all(torch.equal(plain.state[p]["exp_avg"], optimizer.state[q]["exp_avg"])
               for p, q in zip(into.parameters(), model.parameters()))


def test_an_earlier_versions_compiled_optimiser_names_load_as_the_parameters_own(tmp_path):
    """An earlier version stored the ``param_names`` of an optimiser built from
    ``torch.compile(model).named_parameters()`` as given (``_orig_mod.<name>``): an optimiser of
    the plain model that loaded such a checkpoint took the compiled names (torch keeps the stored
    ones). They are read as the weights' own names."""
    import json

    from attnres.checkpoint import load_checkpoint, save_checkpoint
    from attnres.checkpoint.manifest import STATE_FILE, seal_state

    model = tiny_model()
    optimizer = torch.optim.AdamW(model.named_parameters())
    state = {"config": {"model": model.config.to_dict()}}
    path = save_checkpoint(tmp_path / "run", 1, model, optimizer, state, keep=1)
    doc = json.loads((path / STATE_FILE).read_text())
    own = doc["optimizer"]["param_groups"][0]["param_names"]
    doc["optimizer"]["param_groups"][0]["param_names"] = [f"_orig_mod.{name}" for name in own]  # (the old names)
    (path / STATE_FILE).write_text(json.dumps(seal_state(doc)))
    plain = torch.optim.AdamW(tiny_model().named_parameters())
    load_checkpoint(path, tiny_model(), plain, restore_rng=False)
    assert list(plain.state_dict()["param_groups"][0]["param_names"]) == own


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_numpy_integers_are_taken_wherever_generate_takes_ints(decode):
    """``generate(model, ids, max_new_tokens=np.int64(3))`` (a count from a NumPy array or a
    pandas sweep) passed generate's check and was refused by the cache it makes, naming an
    argument the call never had: "KVCache: capacity must be an integer >= 0, got
    np.int64(10)". The caches take any integer, as ``generate`` does: the same tokens."""
    np = pytest.importorskip("numpy")
    from attnres.inference import KVCache, StaticKVCache, generate, prefill

    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))

    def tokens(count):
        return generate(model, ids, max_new_tokens=count, temperature=0.7, decode=decode,
                        generator=torch.Generator().manual_seed(0))

    assert torch.equal(tokens(np.int64(3)), tokens(3))
    assert prefill(model, ids, capacity=np.int64(20))[1].seq_len == 8
    assert KVCache(np.int32(2), capacity=np.int64(4)).n_layers == 2
    assert StaticKVCache.for_model(model, np.int64(2), np.int64(16)).capacity == 16


@pytest.mark.parametrize("call, said", [
    (lambda: ModelConfig.preset("tiny", residual="ATTNRES_FULL"), "ModelConfig.residual.kind must be one of"),
    (lambda: ModelConfig.preset("TINY"), "unknown preset"),
    (lambda: ModelConfig.preset("tiny", residual={"schedule": "TWO_PHASE"}), "ModelConfig.residual.schedule must be"),
    (lambda: ModelConfig.preset("tiny", hf_architecture="QWEN3"), "ModelConfig.hf_architecture must be"),
])
def test_a_choice_written_in_another_case_is_named_in_its_own(call, said):
    """Choices are lower case, and a notebook writes ``residual="ATTNRES_FULL"`` or
    ``preset("TINY")``: the refusal listed the choices but suggested none (difflib compares
    case: 'attnres_full' is not near 'ATTNRES_FULL'), as it does for 'AttnRes_Block'. Still
    refused - the names are the ones configs and checkpoints store - naming the one meant."""
    with pytest.raises((ValueError, KeyError), match=said) as error:
        call()
    meant = re.search(r"got '(\w+)'|unknown preset '(\w+)'", str(error.value)).group(1, 2)
    assert f"(did you mean '{next(m for m in meant if m).lower()}'?)" in str(error.value)


def test_a_hook_on_a_module_the_model_never_calls_warns_naming_what_to_hook():
    """``model.layers[i].register_forward_hook(...)`` - a notebook capturing each block's
    output - and a hook on ``model.residual`` never ran: the residual calls a block's two
    sublayers apart and is driven through its methods, so the hook got nothing, without a word
    (this suite's own check that no block ran before a refusal held so). Registering one warns,
    naming what to hook; it is registered all the same (tools that hook every module go on),
    and a hook on a module that runs (``attn``) is quiet."""
    import warnings

    model = tiny_model()
    for module, instead in ((model.layers[0], r"\.attn and \.mlp give their raw outputs"),
                            (model.residual, r"return_depth_weights=True")):
        for register in (module.register_forward_pre_hook, module.register_forward_hook,
                         module.register_full_backward_pre_hook, module.register_full_backward_hook):
            with pytest.warns(UserWarning, match=rf"^a \w+ (pre-)?hook on {type(module).__name__} never runs: .*"
                                                 rf"{instead}") as caught:
                register(lambda *args: None)
            assert caught[0].filename == __file__  # (the user's line)
        assert len(module._forward_pre_hooks) == len(module._forward_hooks) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.layers[0].attn.register_forward_hook(lambda *args: None)


def test_a_config_changed_after_building_a_model_leaves_that_model_as_built():
    """A notebook that builds a model per size from one config (``config.n_layers = n`` in a
    loop) gave every model the last one's config - the model holds the object it was given - so
    the first model said 3 layers and had 2: ``generate`` failed with "KVCache layers hold
    different lengths [4, 4, 0]: a forward was interrupted", an export with missing keys. Each
    model keeps a copy of its config: what it was built from."""
    from attnres.inference import generate

    config, models = ModelConfig.preset("tiny"), []
    for n_layers in (2, 3):
        config.n_layers = n_layers
        models.append(AttnResLM(config))
    assert [m.config.n_layers for m in models] == [len(m.layers) for m in models] == [2, 3]
    ids = torch.randint(0, 256, (1, 4))
    assert generate(models[0].eval(), ids, max_new_tokens=2).shape == (1, 2)



def test_the_state_dict_of_a_compiled_model_loads_into_the_model(tmp_path):
    """``torch.compile(model).state_dict()`` names every weight ``_orig_mod.<name>``:
    ``model.load_state_dict`` of it failed ("Missing key(s) in state_dict: embed_tokens.weight,
    ... Unexpected key(s): _orig_mod.embed_tokens.weight, ..."), and so did ``load_run`` of a
    checkpoint an earlier version saved from a compiled model. The names load as the model's
    own (no module of the model is called ``_orig_mod``): the same logits."""
    from attnres.checkpoint import write_checkpoint
    from attnres.inference import load_run

    model, ids = tiny_model(), torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    logits, compiled = model(ids).logits, torch.compile(model)
    into = tiny_model()
    into.load_state_dict(compiled.state_dict())
    assert torch.equal(into(ids).logits, logits)
    write_checkpoint(tmp_path / "run", 1, compiled.state_dict(), torch.optim.AdamW(model.parameters()).state_dict(),
                     {"config": {"model": model.config.to_dict()}}, keep=1)
    assert torch.equal(load_run(tmp_path / "run").model(ids).logits, logits)


class _Wrapper(torch.nn.Module):
    """A user's module around the model: the model as ``.model`` and a weight of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.model, self.scale = tiny_model(), torch.nn.Parameter(torch.ones(()))

    def forward(self, ids):
        return self.scale * self.model(ids).logits


def test_a_checkpoint_of_a_users_module_around_the_model_loads_whatever_part_of_it_is_compiled(tmp_path):
    """The loaders knew ``torch.compile`` only around the model itself (``_orig_mod.<name>``):
    the state dict of ``torch.compile(wrapper)``, a user's module around the model, written
    with ``write_checkpoint`` (``_orig_mod.model.<name>``), did not load into ``wrapper``
    ("does not fit the model: missing ['model.embed_tokens.weight', ...]"), nor a checkpoint of
    ``wrapper`` into one whose model is compiled (``model._orig_mod.<name>``). Checkpoints store
    the weights' own names, and a name that differs from the model's only in ``_orig_mod.``
    loads as the model's: the same logits every way."""
    from safetensors.torch import load_file

    from attnres.checkpoint import load_checkpoint, save_checkpoint, write_checkpoint

    wrapper, ids = _Wrapper(), torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        for p in wrapper.parameters():
            p.normal_(0, 0.1)
    logits = wrapper(ids)

    def adamw(module):
        return torch.optim.AdamW(module.parameters())

    path = write_checkpoint(tmp_path / "a", 1, torch.compile(wrapper).state_dict(), adamw(wrapper).state_dict(), {},
                            keep=1)
    assert "model.norm.weight" in load_file(str(path / "model.safetensors"))
    into = _Wrapper()
    load_checkpoint(path, into, restore_rng=False)
    assert torch.equal(into(ids), logits)
    path = save_checkpoint(tmp_path / "b", 1, wrapper, adamw(wrapper), {}, keep=1)
    into = _Wrapper()
    into.model = torch.compile(into.model)
    load_checkpoint(path, into, restore_rng=False)
    assert torch.equal(into.scale * into.model._orig_mod(ids).logits, logits)
    path = save_checkpoint(tmp_path / "c", 1, into, adamw(into), {}, keep=1)  # (its model compiled)
    into = _Wrapper()
    load_checkpoint(path, torch.compile(into), restore_rng=False)
    assert torch.equal(into(ids), logits)


class _Keeper(torch.nn.Module):
    """A user's module that keeps the model it adapts as its own ``_orig_mod`` attribute (not
    ``torch.compile``'s wrapper), with a weight of its own."""

    def __init__(self) -> None:
        super().__init__()
        self._orig_mod, self.scale = tiny_model(), torch.nn.Parameter(torch.ones(()))


def test_a_users_module_with_an_attribute_named_orig_mod_is_not_taken_for_a_compiled_one(tmp_path):
    """Any module with an ``_orig_mod`` attribute was taken for ``torch.compile``'s wrapper and
    the attribute for the whole module: ``save_checkpoint`` writes all of its weights (the
    names without ``_orig_mod.``), yet ``load_checkpoint`` loaded into the attribute alone
    ("does not fit the model: ... unexpected ['scale']"), and ``generate`` took the module for
    the model it holds. Only the wrapper is unwrapped."""
    from attnres.checkpoint import load_checkpoint, save_checkpoint
    from attnres.nn.compiled import uncompiled

    keeper = _Keeper()
    with torch.no_grad():
        keeper.scale.fill_(3.0)
    path = save_checkpoint(tmp_path / "a", 1, keeper, torch.optim.AdamW(keeper.parameters()), {}, keep=1)
    into = _Keeper()
    load_checkpoint(path, into, restore_rng=False)
    assert into.scale.item() == 3.0
    assert uncompiled(keeper) is keeper and uncompiled(torch.compile(keeper)) is keeper


def test_a_checkpoint_of_untied_weights_does_not_load_into_a_tied_model_nor_hide_a_missing_weight(tmp_path):
    """A tied weight is stored once and its other names are filled by the tie; since the
    loaders share ``load_weights`` a tie was told by ``data_ptr()``: a checkpoint of an untied
    model (the embedding and the LM head apart) loaded into a tied one without a word, the
    LM head's values over the embedding's (safetensors' ``load_model`` refused it); and on the
    meta device, or for an empty tensor, every ``data_ptr()`` is 0, so a weight the checkpoint
    lacks counted as filled by a tie. Both say what does not fit."""
    import warnings

    from attnres.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, write_checkpoint

    untied = tiny_model()
    adam = torch.optim.AdamW(untied.parameters())
    path = save_checkpoint(tmp_path / "a", 1, untied, adam, {}, keep=1)
    with pytest.raises(CheckpointError, match=r"does not fit the model: missing \[\], unexpected \[\], tied here but "
                                              r"apart in the checkpoint \[\['embed_tokens.weight', 'lm_head.weight'\]\]"):
        load_checkpoint(path, tiny_model(tie_embeddings=True), restore_rng=False)
    tied = tiny_model(tie_embeddings=True)  # (stored once: loads, the tie filling the other name)
    path = save_checkpoint(tmp_path / "b", 1, tied, torch.optim.AdamW(tied.parameters()), {}, keep=1)
    into = tiny_model(tie_embeddings=True)
    with torch.no_grad():
        into.lm_head.weight.zero_()
    load_checkpoint(path, into, restore_rng=False)
    assert torch.equal(into.lm_head.weight, tied.embed_tokens.weight) and into.lm_head.weight is into.embed_tokens.weight
    weights = {k: v for k, v in untied.state_dict().items() if k != "norm.weight"}
    path = write_checkpoint(tmp_path / "c", 1, weights, adam.state_dict(), {}, keep=1)
    with torch.device("meta"):
        meta = tiny_model()
    with warnings.catch_warnings(), pytest.raises(CheckpointError, match=r"missing \['norm.weight'\], unexpected \[\]$"):
        warnings.simplefilter("ignore")  # (copying into a meta parameter is a no-op, with a warning)
        load_checkpoint(path, meta, restore_rng=False)

    def with_empty(model):  # (two empty buffers: neither is the other's tie)
        model.register_buffer("empty_a", torch.zeros(0))
        model.register_buffer("empty_b", torch.zeros(0))
        return model

    path = save_checkpoint(tmp_path / "d", 1, with_empty(untied), adam, {}, keep=1)
    load_checkpoint(path, with_empty(tiny_model()), restore_rng=False)  # (each stored: the model loads)
    weights = {k: v for k, v in untied.state_dict().items() if k != "empty_b"}
    path = write_checkpoint(tmp_path / "e", 1, weights, adam.state_dict(), {}, keep=1)
    with pytest.raises(CheckpointError, match=r"missing \['empty_b'\], unexpected \[\]$"):
        load_checkpoint(path, with_empty(tiny_model()), restore_rng=False)


def test_the_standard_residual_given_another_variants_option_names_itself():
    """Swapping the baseline into one's own model, ``BlockAttnRes(d, L, block_size=2)`` ->
    ``StandardResidual(d, L, block_size=2)``, was refused naming another class:
    "ResidualStream.__init__() got an unexpected keyword argument 'block_size'"."""
    from attnres.nn import StandardResidual

    with pytest.raises(TypeError, match=r"^StandardResidual\.__init__\(\) got an unexpected keyword argument "
                                        r"'block_size'$"):
        StandardResidual(64, 8, block_size=2)
    assert StandardResidual(64, 8).n_sublayers == 8


def test_two_weights_one_name_without_orig_mod_are_refused_at_save(tmp_path):
    """A checkpoint names weights without ``torch.compile``'s ``_orig_mod.``: a module holding
    both ``w`` and ``_orig_mod.w`` (its own attribute so named) stored one over the other
    without a word. The save is refused, naming both."""
    from attnres.checkpoint import save_checkpoint

    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._orig_mod = torch.nn.Linear(2, 2)
            self.weight = torch.nn.Parameter(torch.ones(2, 2))

    both = Both()
    with pytest.raises(ValueError, match=r"'weight' and '_orig_mod.weight' are both stored as 'weight'"):
        save_checkpoint(tmp_path / "a", 1, both, torch.optim.SGD(both.parameters(), lr=0.1), {}, keep=1)
    assert not (tmp_path / "a").exists()  # (refused before anything is written)
