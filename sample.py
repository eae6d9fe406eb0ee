"""Sample text from a trained checkpoint (see model/generate.py for how SA decodes).

    python sample.py ckpt=runs/train/<run> prompt="The history of" num_samples=3
    python sample.py ckpt=<file>.ckpt temperature=0 max_new_tokens=50       # greedy
    python sample.py ckpt=<run dir> attention=swa                           # as SWA, at the trained window
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_sample_config(cfg: DictConfig) -> None:
    from model.config import ConfigError, _is_int, _is_number

    if not cfg.ckpt:
        raise ConfigError("ckpt", cfg.ckpt, "give ckpt=<run dir, .ckpt or weights .pt file>")
    for key in ("num_samples", "max_new_tokens"):
        if not _is_int(cfg[key]) or cfg[key] < 1:
            raise ConfigError(key, cfg[key], "a positive integer")
    if not _is_number(cfg.temperature) or not 0 <= cfg.temperature < float("inf"):  # nan fails the compare too
        raise ConfigError("temperature", cfg.temperature, "a finite number >= 0 (0: greedy)")
    if cfg.top_k is not None and (not _is_int(cfg.top_k) or cfg.top_k < 1):
        raise ConfigError("top_k", cfg.top_k, "a positive integer, or null for no cut")
    if cfg.top_p is not None and (not _is_number(cfg.top_p) or not 0 < cfg.top_p <= 1):
        raise ConfigError("top_p", cfg.top_p, "a probability in (0, 1], or null")
    if cfg.dtype not in DTYPES:
        raise ConfigError("dtype", cfg.dtype, f"one of {', '.join(DTYPES)}")
    if not _is_int(cfg.seed):
        raise ConfigError("seed", cfg.seed, "an integer")
    if cfg.prompt is not None and not isinstance(cfg.prompt, str):  # prompt=123 or =true: Hydra read a number
        raise ConfigError("prompt", cfg.prompt, "text; quote what Hydra would read as a number or a boolean: "
                          "prompt=\"'123'\"")
    check_device(cfg.device)


def check_device(device: str) -> None:
    import torch

    from model.config import ConfigError

    if device == "auto":
        return
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError):
        where = None
    if where is None or where.type not in ("cpu", "cuda"):
        raise ConfigError("device", device, "auto, cpu, cuda or cuda:<index>")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", device, "CUDA is not available on this machine: device=cpu or auto")
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise ConfigError("device", device, f"this machine has {torch.cuda.device_count()} CUDA device(s)")


def sample(cfg: DictConfig, given: set[str] | None = None) -> list[str]:
    """The texts (prompt + continuation) of cfg.num_samples samples. `given`: the attention keys the command line
    set (model.config.attention_given); an attention preset's window and eval seed are not a choice of this model's
    (None: every set key of cfg.attention counts as given)."""
    import torch

    from model.checkpoint import load_checkpoint
    from model.config import attention_from_command_line, attention_label, trained_window_unless_given
    from model.generate import generate

    check_sample_config(cfg)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    attention = attention_from_command_line(OmegaConf.to_container(cfg.attention, resolve=True))
    if given is not None:
        attention = trained_window_unless_given(attention, given)
    loaded = load_checkpoint(cfg.ckpt, attention=attention or None, device=device)
    trained = loaded.hparams.get("attention") or {}
    # as tables name them: a full-attention model has no window (its config's is a placeholder)
    now = attention_label(loaded.model.attn_cfg.kind, loaded.model.attn_cfg.window)
    was = attention_label(trained.get("kind"), trained.get("window"))
    if trained.get("kind") is not None and now != was:
        print(f"note: sampling as {now}; the checkpoint was trained as {was}", file=sys.stderr)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    text = cfg.prompt or ""  # null, as "": unconditioned
    prompt = loaded.tokenizer.encode(text, add_special_tokens=False).ids if text else [loaded.eos_id]
    generator = torch.Generator(device=device).manual_seed(int(cfg.seed))
    samples = generate(loaded.model, prompt, int(cfg.max_new_tokens), int(cfg.num_samples), float(cfg.temperature),
                       cfg.top_k, cfg.top_p, loaded.eos_id, generator,
                       None if dtype == "float32" else getattr(torch, dtype))
    return [text + continuation(loaded.tokenizer, prompt, ids) for ids in samples]


def continuation(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text `ids` add after `prompt`, decoded together: decoded alone, a SentencePiece-style decoder (Llama-2,
    Mistral) strips the continuation's leading space and glued its first word to the prompt's last."""
    head, whole = tokenizer.decode(prompt), tokenizer.decode(prompt + list(ids))
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(ids)


@hydra.main(version_base="1.3", config_path="conf", config_name="sample")
def main(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig

    from model.checkpoint import CheckpointError
    from model.config import ConfigError, attention_given, refuse_context_given
    from tools.config_hints import refuse_unread_top_keys_of_launch

    try:
        refuse_unread_top_keys_of_launch(cfg, "sample")
        refuse_context_given(HydraConfig.get().overrides.task, "the sampler conditions on the last that many tokens")
        texts = sample(cfg, attention_given(HydraConfig.get().overrides.task))
    except (ConfigError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for i, text in enumerate(texts):
        print(f"--- sample {i + 1} of {len(texts)}\n{text}")


if __name__ == "__main__":
    from tools.config_hints import run_with_key_hints

    run_with_key_hints(main, "sample")
