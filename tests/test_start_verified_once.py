"""Under several ranks, the checkpoint a run resumes (or starts from) is verified by rank 0
alone - every file's SHA-256, once, not once per rank from the shared file system - and
every rank starts from the checkpoint rank 0 picked, also when the newest one does not
verify and rank 0 falls back to an older one. (A sharded one's files are checked again as it
loads, each rank those it reads: tests/test_sharded_checkpoints.py's 2-rank cases.)

Run as a script by :func:`attnres.distributed.local_spawn.run_local` (the workers), as a
test by pytest.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


STEPS = 2


def run_args(corpus: Path, out: Path, **extra) -> list[str]:
    base = {"model": "tiny", "model.d_model": 16, "model.n_layers": 2, "data.paths": f"[{corpus}]",
            "data.tokenizer": "byte", "seq_len": 8, "batch_size": 2, "steps": STEPS, "warmup_steps": 1,
            "out_dir": str(out), "progress": "false", "tensorboard": "false", "eval_every": 100,
            "log_every": 1, "diagnostics_every": 100, "checkpoint_every": 1}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


# -- the worker ---------------------------------------------------------------------------

def worker(root: Path) -> None:
    """Locate the start of each case below on this rank, counting the files it hashes, and
    write what it found to ``<root>/<case>-rank<r>.json``."""
    import warnings

    from attnres.checkpoint import manifest
    from attnres.distributed.launch import main_first, patient, process_context
    from attnres.train.config import load_config
    from attnres.train.setup import locate_start

    ctx = process_context("cpu")
    group = patient(ctx)
    hashed: list[str] = []
    sha256 = manifest._sha256
    manifest._sha256 = lambda path: hashed.append(Path(path).name) or sha256(path)
    cases = {"resume": ("run", {"resume": "true"}), "resume_from": ("fresh", {"resume_from": root / "broken"}),
             "init_from": ("init", {"init_from": root / "run"})}
    for case, (out, extra) in cases.items():
        hashed.clear()
        config = load_config(None, run_args(root / "corpus.txt", root / out, **extra))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (rank 0 warns of the checkpoint it skips)
            start = locate_start(config, ctx.is_main, lambda fn, **kw: main_first(fn, group, **kw))
        source = start.resume or start.init
        found = {"path": str(source.path), "step": source.step, "hashed": len(hashed)}
        (root / f"{case}-rank{ctx.rank}.json").write_text(json.dumps(found))


# -- the test -----------------------------------------------------------------------------

def test_two_ranks_start_from_the_checkpoint_rank_0_verified(tmp_path):
    from attnres.checkpoint import checkpoint_path
    from attnres.distributed.local_spawn import run_local
    from attnres.train import train
    from attnres.train.config import load_config

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 40, encoding="utf-8")
    train(load_config(None, run_args(corpus, tmp_path / "run")))
    # another run whose newest checkpoint does not verify (one byte changed, same size)
    shutil.copytree(tmp_path / "run", tmp_path / "broken")
    weights = checkpoint_path(tmp_path / "broken", STEPS) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))

    src = str(Path(__file__).resolve().parents[1] / "src")
    run_local([__file__, str(tmp_path)], 2, timeout=300,
              env={"PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])})

    expected = {"resume": checkpoint_path(tmp_path / "run", STEPS),
                "resume_from": checkpoint_path(tmp_path / "broken", STEPS - 1),
                "init_from": checkpoint_path(tmp_path / "run", STEPS)}
    for case, path in expected.items():
        rank0, rank1 = (json.loads((tmp_path / f"{case}-rank{r}.json").read_text()) for r in (0, 1))
        assert rank0["path"] == rank1["path"] == str(path), case
        assert rank0["step"] == rank1["step"] == int(path.name.split("-")[1]), case
        assert rank0["hashed"] > 0, f"{case}: rank 0 verified nothing"
        assert rank1["hashed"] == 0, f"{case}: rank 1 hashed {rank1['hashed']} files rank 0 had verified"


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
