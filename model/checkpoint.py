"""Rebuild a trained decoder (and its tokenizer) from a checkpoint file or a run directory; thin out a run's
older step checkpoints to their weights.

Checkpoints are Lightning checkpoints whose state dict does not depend on the attention backend; they carry the
model/attention configs (hyper_parameters) and the tokenizer JSON, so a checkpoint alone is enough to evaluate.
Loaded with weights_only=True.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from model.config import AttentionConfig, ModelConfig, check_window_for
from model.decoder import Decoder


class CheckpointError(ValueError):
    """A file that is no readable checkpoint of this codebase (truncated, another format, another program's), or
    whose weights do not fit the model its hyper-parameters describe."""


def read_checkpoint(path: Path) -> dict:
    """A checkpoint's contents (weights_only; mmap: only the tensors read are paged in, and a training checkpoint is
    ~2/3 AdamW moments), or a CheckpointError that names the file and what is wrong with it instead of torch's
    traceback (whose advice for these files is about mmap and the zip format)."""
    import pickle
    import zipfile

    if not zipfile.is_zipfile(path):  # torch.save's archive: its directory sits at the end, so a cut file has none
        raise CheckpointError(f"{path} is not a readable checkpoint: no torch.save archive (truncated, e.g. by a full "
                              "disk or a killed copy, or a file of another format)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:  # weights_only refused an object: its "Unsupported global" says which
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).splitlines()]
        why = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else "")
        raise CheckpointError(f"{path} holds objects other than tensors and plain values, which weights_only loading "
                              f"refuses (not a checkpoint of this codebase?): {why[:300]}") from err
    except Exception as err:  # noqa: BLE001 - a damaged archive: torch's errors differ by what is damaged
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(f"{path} is not a readable checkpoint (a damaged archive): {reason[:300]}") from err
    if not isinstance(ckpt, dict) or not {"state_dict", "hyper_parameters"} <= ckpt.keys():
        raise CheckpointError(f"{path} is not a checkpoint of this codebase (no state_dict and hyper_parameters: "
                              "give a train.py run directory, its .ckpt or its weights/step<N>.pt)")
    return ckpt


@dataclass
class LoadedModel:
    model: Decoder
    tokenizer: object  # tokenizers.Tokenizer
    eos_id: int
    checkpoint: Path
    hparams: dict
    loss_only_after: str | None = None  # the training objective (data.loss_only_after): None = every token
    step: int | None = None  # the checkpoint's global step
    mtime_ns: int | None = None  # the file's modification time when it was read
    attempt: str | None = None  # the training attempt that wrote it (None: written before 2026-12-04)

    def identity(self) -> dict:
        """What results.json records of the scored file: a later last.ckpt of a resumed run is another file, and
        tools.runs leaves out the results of the earlier one (or of an abandoned attempt's, told by the attempt id when
        a restart ended at the same step). trained_attention and trained_context: what the
        weights were trained with (results under another attention or context are reported apart)."""
        trained = self.hparams.get("attention") or {}
        return {"checkpoint_step": self.step, "checkpoint_mtime_ns": self.mtime_ns, "checkpoint_attempt": self.attempt,
                "trained_attention": {k: trained[k] for k in ("kind", "window", "eval_seed") if k in trained},
                "trained_context": ModelConfig(**self.hparams["model"]).max_seq_len}


def find_checkpoint(path: str | Path) -> Path:
    """A .ckpt file as is; a run directory -> its checkpoints/last.ckpt, else its highest step checkpoint (by step
    and version, as tools.runs picks the run's final one: modification times do not survive every copy), else its
    newest other .ckpt."""
    path = Path(path)
    if path.is_file():
        return path
    for folder in (path / "checkpoints", path):
        if (folder / "last.ckpt").is_file():
            return folder / "last.ckpt"
        found = step_checkpoints(folder) or sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no checkpoint at {path} (give a .ckpt file or a run directory with checkpoints/)")


def load_checkpoint(path: str | Path, attention: dict | None = None, device: str | torch.device = "cpu",
                    context: int | None = None, window_if_banded: bool = False) -> LoadedModel:
    """Rebuild the model; `attention` overrides the trained attention config (e.g. another window or backend);
    `context` builds it for sequences of up to that many tokens instead of the trained max_seq_len (the RoPE tables
    are not saved; positions past the trained context are extrapolation). A window given for a model that runs full
    attention is refused (it would change nothing); with `window_if_banded` it is dropped instead, for a tool that
    scores several runs with one window and applies it to the banded ones."""
    from tokenizers import Tokenizer

    from data.tokenizer import eos_id

    ckpt_path = find_checkpoint(path)
    mtime_ns = ckpt_path.stat().st_mtime_ns  # before reading: a run that rewrites it meanwhile makes it stale
    ckpt = read_checkpoint(ckpt_path)
    hp = ckpt["hyper_parameters"]
    attention = dict(attention or {})
    if window_if_banded and attention.get("kind", hp["attention"].get("kind")) == "full":
        attention.pop("window", None)
    attn = {**hp["attention"], **attention}
    check_window_for(hp["attention"].get("kind"), attn.get("kind"), attention.get("window"),
                     f"checkpoint {ckpt_path}")
    model_cfg = {**hp["model"], **({"max_seq_len": int(context)} if context else {})}
    model = Decoder(ModelConfig(**model_cfg), AttentionConfig(**attn), seed=hp.get("seed", 0))
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A gated checkpoint evaluated as plain SA/SWA drops its gates; anything else missing is an error.
    if missing and all(".attn.gate." in k for k in missing) and not unexpected:
        from model.config import ConfigError

        raise ConfigError("attention.kind", attn["kind"], f"checkpoint {ckpt_path} was trained as "
                          f"{hp['attention']['kind']!r} and has no gates; evaluate it as full, swa or sa")
    if missing or [k for k in unexpected if ".attn.gate." not in k]:
        raise CheckpointError(f"checkpoint {ckpt_path} does not match the model: missing {missing}, "
                           f"unexpected {unexpected}")
    if "tokenizer" not in ckpt:
        raise CheckpointError(f"checkpoint {ckpt_path} carries no tokenizer (written by an older version?)")
    tokenizer = Tokenizer.from_str(ckpt["tokenizer"])
    tokenizer.encode_special_tokens = True  # text is text, as data.prepare encoded the training documents
    model.to(device).eval()
    return LoadedModel(model, tokenizer, eos_id(tokenizer), ckpt_path, hp, ckpt.get("loss_only_after"),
                       ckpt.get("global_step"), mtime_ns, ckpt.get("attempt"))


def checkpoint_identity(path: Path) -> tuple[str | None, int | None]:
    """(the training attempt that wrote a checkpoint, its step); (None, None) where unreadable."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - unreadable: the caller falls back to what else it knows
        return None, None
    return ckpt.get("attempt"), ckpt.get("global_step")


def check_same_shape(saved_model: dict, cfg: ModelConfig, source: str) -> None:
    """Refuse a model config whose parameter shapes differ from those a checkpoint was trained with."""
    from model.config import ConfigError
    from model.lightning_module import SHAPE_KEYS

    saved = ModelConfig(**saved_model)
    for key in SHAPE_KEYS:
        if getattr(saved, key) != getattr(cfg, key):
            raise ConfigError(f"model.{key}", getattr(cfg, key), f"{source} was trained with "
                              f"{getattr(saved, key)!r}; its weights do not fit another shape")


def load_weights_into(model: Decoder, path: str | Path) -> dict:
    """Copy a checkpoint's weights into `model` (train.py's init_from: a new run starts from them at step 0 with a
    fresh optimizer). The shapes must agree; the attention and the context may differ (RoPE tables are not saved):
    SA or SWA weights start a gated SA+SWA model with its gates at 0.5, a gated model's gates are dropped for a
    plain one. Returns what was loaded: checkpoint, step, trained attention, tokenizer JSON, dropped gates,
    where its data stream stood (samples), its seed and data config."""
    ckpt_path = find_checkpoint(path)
    ckpt = read_checkpoint(ckpt_path)
    check_same_shape(ckpt["hyper_parameters"]["model"], model.cfg, f"init_from={ckpt_path}")
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if [k for k in missing if ".attn.gate." not in k] or [k for k in unexpected if ".attn.gate." not in k]:
        raise CheckpointError(f"{ckpt_path} does not fit the model: missing {missing}, unexpected {unexpected}")
    return {"checkpoint": str(ckpt_path), "step": ckpt.get("global_step"),
            "attention": dict(ckpt["hyper_parameters"].get("attention") or {}), "tokenizer": ckpt.get("tokenizer"),
            "dropped_gates": bool(unexpected), "new_gates": bool(missing), "samples": stream_position(ckpt),
            "seed": ckpt["hyper_parameters"].get("seed"), "data": ckpt["hyper_parameters"].get("data")}


def stream_position(ckpt: dict) -> int | None:
    """Training samples (windows) of its data stream a checkpoint's run had reached: those it skipped at the start
    (an init_from run that continued its source's stream) and steps x ranks x accumulation x batch. None for a
    checkpoint that does not record its layout (an older one)."""
    hp, layout = ckpt.get("hyper_parameters") or {}, ckpt.get("layout")
    if not layout or ckpt.get("global_step") is None or not (hp.get("data") or {}).get("batch_size"):
        return None
    own = int(ckpt["global_step"]) * int(layout["world_size"]) * int(layout["accumulate_grad_batches"]) * \
        int(hp["data"]["batch_size"])
    return own + int((hp.get("init_from") or {}).get("samples_skipped") or 0)


_STEP_FILE = re.compile(r"step(\d+)(?:-v(\d+))?\.ckpt")
# what only a resume needs: AdamW's two moments are 2/3 of a checkpoint of fp32 weights
TRAINING_STATE = ("optimizer_states", "lr_schedulers", "loops", "callbacks")


def step_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """A run's step<N>.ckpt files, oldest first: by step, then version. ModelCheckpoint writes step<N>-v1.ckpt beside
    an earlier history's step<N>.ckpt (a run continued from an older checkpoint of its own), and the -v1 is newer,
    though it sorts first by name."""
    found = sorted((int(m.group(1)), int(m.group(2) or 0), path) for path in Path(ckpt_dir).glob("step*.ckpt")
                   if (m := _STEP_FILE.fullmatch(path.name)))
    return [path for _, _, path in found]


def prune_step_checkpoints(ckpt_dir: str | Path, keep: int, keep_weights: bool = True) -> list[Path]:
    """Delete all but the `keep` newest step<N>.ckpt files of a run (by step; last.ckpt is never touched). With
    keep_weights each one leaves weights/step<N>.pt behind: the checkpoint without its training state, which
    evaluate.py and load_checkpoint read as they read a .ckpt (no resume from it). Returns the deleted files."""
    from data.shards import atomic_write

    ckpt_dir = Path(ckpt_dir)
    found = step_checkpoints(ckpt_dir)
    pruned = []
    for path in found[: max(0, len(found) - keep)]:
        if keep_weights:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            weights = {k: v for k, v in ckpt.items() if k not in TRAINING_STATE}
            atomic_write(ckpt_dir / "weights" / path.with_suffix(".pt").name, lambda f: torch.save(weights, f))
            del ckpt
        path.unlink()
        pruned.append(path)
    return pruned
