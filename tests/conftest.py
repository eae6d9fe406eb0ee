"""Test-wide settings: offline, CPU-friendly, Triton through its interpreter when there is no GPU."""

import os

import torch

# Must be set before any @triton.jit decorates (kernel modules are imported lazily, after this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def write_corpus(folder: Path, n_docs: int = 400) -> Path:
    """A small English corpus for tests: the pydoc topic pages that ship with Python, as jsonl."""
    from pydoc_data.topics import topics

    pages = [text for _, text in sorted(topics.items()) if len(text) > 200]
    docs = [chunk for page in pages for chunk in page.split("\n\n\n") if len(chunk) > 200][:n_docs]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, corpus_file, data_cache) -> Path:
    """last.ckpt of a 12-step tiny SA run (w=8) on the test corpus; its prepared data stays in data_cache."""
    from train import train

    run_dir = tmp_path_factory.mktemp("eval_run")
    cfg = compose_train(TINY + ["attention=sa", "attention.window=8", "trainer.max_steps=12",
                                "trainer.val_every_n_steps=12", "trainer.checkpoint_every_n_steps=12"],
                        run_dir, corpus_file, data_cache)
    train(cfg)
    return run_dir / "checkpoints" / "last.ckpt"


def compose_train(overrides: list[str], run_dir: Path, corpus: Path | None = None, cache: Path | None = None):
    """The real train.yaml, composed like the command line would, with test-sized defaults and temp paths."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    base = [f"paths.run_dir={run_dir}", f"paths.log_dir={run_dir.parent}",
            f"paths.cache_dir={cache or run_dir / 'cache'}",
            "logger=csv", "trainer.progress_bar=false"]
    if corpus is not None:
        base += ["data=files", f"data.source.paths=[{corpus}]"]
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="train", overrides=base + list(overrides))


TINY = ["model=tiny", "data.batch_size=4", "data.val_windows=4", "data.val_batch_size=4", "optim.warmup_steps=2",
        "optim.lr=3e-3", "trainer.log_every_n_steps=1", "eval.after_train=false"]
