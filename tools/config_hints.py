"""A "did you mean" for the command line's most common mistake: a misspelled config key.

Hydra refuses `attention.windwo=64` with "Key 'windwo' is not in struct" and suggests `+attention.windwo=64`, which
adds the typo as a new key. The entry points run their Hydra main through `run_with_key_hints`: when Hydra stops with
an error, the config is composed again with the command line's group choices only (`attention=sa`,
`experiment=...`) and every dotted key the command line sets that the config lacks is named with its closest keys.
A launch that works pays nothing. A key added with `+` where nothing reads one (`+trainer.gradient_clip_val=1`,
Lightning's name for optim.grad_clip) is refused by `refuse_unread_keys`, which train.py and evaluate.py call, and
one added at the top (`+max_steps=100`) by `refuse_unread_top_keys`, which every entry point calls.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent.parent / "conf"
CONFIG_FLAGS = ("-cn", "-cp", "-cd", "--config-name", "--config-path", "--config-dir")


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(group choices, keys set) of the command line's overrides, read by Hydra's own parser; a sweep's group
    choice takes its first value. Additions (+key), deletions (~key) and Hydra's own settings are not typos."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    groups, keys = [], []
    for override in OverridesParser.create().parse_overrides([a for a in argv if "=" in a and a[0] != "-"]):
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or override.type == OverrideType.DEL:
            continue
        if (CONF / key).is_dir():  # a group choice (+logger=csv adds one): composed, so its keys are known
            try:
                value = next(iter(override.sweep_string_iterator())) if override.is_sweep_override() else \
                    override.get_value_element_as_str()
            except Exception:  # noqa: BLE001 - glob(*) needs Hydra's config loader: the group's default stands
                continue
            prefix = "+" if override.type == OverrideType.ADD else "++" if override.type == OverrideType.FORCE_ADD \
                else ""
            groups.append(f"{prefix}{key}{'@' + override.package if override.package else ''}={value}")
        elif override.type == OverrideType.CHANGE and not key.rpartition(".")[2].isdigit():  # not list items
            keys.append(key)
    return groups, keys


def _all_keys(node, prefix: str = "") -> list[str]:
    from omegaconf import DictConfig

    out = []
    for key in node.keys() if isinstance(node, DictConfig) else []:
        full = f"{prefix}{key}"
        out.append(full)
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            out += _all_keys(child, full + ".")
    return out


def unknown_key_hints(config_name: str, argv: list[str]) -> list[str]:
    """One line per dotted key of `argv` that the composed config does not have, with the closest existing keys."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if any(a.startswith(CONFIG_FLAGS) for a in argv):  # another config than conf/<name>: nothing to compare with
        return []
    groups, keys = _split(argv)
    if not keys:
        return []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
            cfg = compose(config_name=config_name, overrides=groups)
    except Exception:  # noqa: BLE001 - the group choices are wrong themselves: Hydra's own message says so
        return []
    finally:
        GlobalHydra.instance().clear()
    known = _all_keys(cfg)
    hints = []
    for key in keys:
        if key in known:
            continue
        parent, _, leaf = key.rpartition(".")
        siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
        close = [siblings[c] for c in difflib.get_close_matches(leaf, siblings, n=2, cutoff=0.7)]
        if not close and parent:  # a key put in the wrong section: trainer.lr for optim.lr
            close = [k for k in known if k.rpartition(".")[2] == leaf][:2]
        if close:
            guess = f"did you mean {' or '.join(repr(c) for c in close)}?"
        elif siblings:
            guess = f"the keys {'under ' + repr(parent) if parent else 'at the top'}: {', '.join(sorted(siblings))}"
        else:
            guess = f"{parent!r} is not a section of this config"
        hints.append(f"hint: {key!r} is not a key of this config; {guess}")
    return hints


# The keys train.py reads in the sections whose extra keys nothing would read (model and attention are checked by
# their dataclasses, data.probes by data/probes.py; tests/test_config.py keeps these in step with conf/).
READ_KEYS = {
    "trainer": ("accelerator", "devices", "num_nodes", "strategy", "precision", "max_steps", "accumulate_grad_batches",
                "val_every_n_steps", "checkpoint_every_n_steps", "keep_checkpoints", "keep_weights",
                "log_every_n_steps", "progress_bar", "activation_checkpointing", "loss_chunk_tokens", "compile"),
    "optim": ("lr", "weight_decay", "betas", "eps", "warmup_steps", "min_lr_ratio", "schedule", "decay_fraction",
              "grad_clip", "tokens_per_step", "schedule_steps"),
    "data": ("source", "tokenizer", "val_fraction", "val_split", "max_tokens", "shard_tokens", "seq_len", "sampling",
             "window_start", "loss_only_after", "batch_size", "val_windows", "val_batch_size", "num_workers",
             "cache_dir", "probes"),
    "data.source": ("kind", "paths", "text_field", "streaming", "name", "config", "split", "revision"),
    "data.tokenizer": ("path", "vocab_size", "train_chars"),
    "eval": ("name", "tasks", "data_dir", "batch_size", "limit", "num_seeds", "num_fewshot", "after_train", "device",
             "dtype", "max_length", "bootstrap_iters", "task_dir"),
}
# Lightning's (and other trainers') names for what this config spells otherwise
ELSEWHERE = {"trainer.gradient_clip_val": "optim.grad_clip", "trainer.max_epochs": "trainer.max_steps",
             "trainer.val_check_interval": "trainer.val_every_n_steps",
             "trainer.check_val_every_n_epoch": "trainer.val_every_n_steps",
             "trainer.limit_train_batches": "trainer.max_steps", "trainer.lr": "optim.lr",
             "trainer.gradient_accumulation_steps": "trainer.accumulate_grad_batches",
             "optim.gradient_accumulation_steps": "trainer.accumulate_grad_batches",
             "optim.beta1": "optim.betas", "optim.beta2": "optim.betas", "optim.max_lr": "optim.lr",
             "optim.learning_rate": "optim.lr", "data.micro_batch_size": "data.batch_size",
             "data.block_size": "data.seq_len", "data.context_length": "data.seq_len",
             "eval.fewshot": "eval.num_fewshot", "eval.shots": "eval.num_fewshot", "eval.n_shot": "eval.num_fewshot",
             "eval.seeds": "eval.num_seeds"}


def unread_key(key: str) -> bool:
    """Whether refuse_unread_keys refuses a dotted key ("optim.warmup": yes; "optim.lr", "model.foo": no)."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in READ_KEYS and parts[i] not in READ_KEYS[".".join(parts[:i])]
               for i in range(1, len(parts)))


def refuse_unread_keys(cfg) -> None:
    """Raise ConfigError for a key of trainer, optim, data or eval that nothing reads: added with `+` (Hydra's own
    advice for a misspelled key), it would be ignored in silence and the run would go on without it."""
    from omegaconf import DictConfig, OmegaConf

    from model.config import ConfigError

    for section, read in READ_KEYS.items():
        node = OmegaConf.select(cfg, section, default=None)
        if not isinstance(node, DictConfig):
            continue
        for key in node.keys():
            if key in read:
                continue
            full = f"{section}.{key}"
            close = ELSEWHERE.get(full) or next(iter(difflib.get_close_matches(str(key), read, n=1, cutoff=0.6)), None)
            close = f"{section}.{close}" if close and "." not in close else close
            raise ConfigError(full, node._get_node(key)._value(), "a key nothing reads: it would be ignored "
                              f"(remove the +{full}=...)" + (f"; did you mean {close}?" if close else
                                                               f"; the keys of {section}: {', '.join(read)}"))


def _top_additions(overrides: list[str]) -> list[str]:
    """The top-level keys `overrides` add with + or ++ (not a group choice, not Hydra's own)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    out = []
    for text in overrides:
        override = OverridesParser.create().parse_override(text)
        key = override.key_or_group
        if override.type in (OverrideType.ADD, OverrideType.FORCE_ADD) and "." not in key and "/" not in key \
                and key != "hydra" and not (CONF / key).is_dir():
            out.append(key)
    return out


def declared_top_keys(config_name: str, overrides: list[str] = ()) -> set[str]:
    """The top-level keys conf/<config_name>.yaml composes by itself: its own, its groups', and those the chosen
    option of a group sets at the top (experiment=paper_360m's train_tokens; the option `overrides` choose, else
    the default)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    root = OmegaConf.load(CONF / f"{config_name}.yaml")
    chosen = {}
    for override in OverridesParser.create().parse_overrides([o for o in overrides if "=" in o]):
        if (CONF / override.key_or_group).is_dir() and not override.is_sweep_override():
            chosen[override.key_or_group] = override.get_value_element_as_str()
    keys = {str(k) for k in root if k not in ("defaults", "hydra")}
    for entry in root.get("defaults") or []:
        if isinstance(entry, str):  # _self_
            continue
        group, option = next(iter(entry.items()))
        if " " in group or "/" in group:  # an override of Hydra's own groups
            continue
        keys.add(group)
        path = CONF / group / f"{chosen.get(group, option)}.yaml"
        if path.is_file() and path.read_text().startswith("# @package _global_"):
            keys |= {str(k) for k in OmegaConf.load(path) if k not in ("defaults", "hydra")}
    return keys


def _read_by(key: str, values: list[str]) -> bool:
    """Whether an interpolation among `values` may read the top-level `key`: the key as a word in a value that holds
    one, in any spelling (${key}, ${..key}, ${oc.select: "key",1}). A nested key of that name counts too: a key
    wrongly taken for read is left as it was, never refused."""
    import re

    word = re.compile(r"(?<!\w)" + re.escape(key) + r"(?!\w)")
    return any("${" in value and word.search(value) for value in values)


def _interpolating_values(node) -> list[str]:
    if isinstance(node, dict):
        return [v for child in node.values() for v in _interpolating_values(child)]
    if isinstance(node, list):
        return [v for child in node for v in _interpolating_values(child)]
    return [node] if isinstance(node, str) and "${" in node else []


def _override_values(overrides: list[str]) -> list[str]:
    return [o.partition("=")[2] for o in overrides]


def unread_top_key(key: str, overrides: list[str]) -> bool:
    """Whether a top-level key added by train.py's `overrides` is neither composed by the config nor read by any of
    them: for a resume, whose run recorded such a key before they were refused."""
    return key not in declared_top_keys("train", overrides) and not _read_by(key, _override_values(overrides))


def refuse_unread_top_keys(cfg, config_name: str, overrides: list[str], hydra_overrides: list[str] = ()) -> None:
    """Raise ConfigError for a top-level key that `overrides` (the command line's) add with `+` (Hydra's advice for
    `max_steps=100`) when the config does not compose it and no interpolation reads it (`+tokens=2e9` for
    `trainer.max_steps='${steps:${tokens},...}'`, or in a hydra.run.dir, is read): the run would go on without it."""
    from omegaconf import OmegaConf

    from model.config import ConfigError

    declared = declared_top_keys(config_name, overrides)
    added = [key for key in _top_additions(overrides) if key not in declared]
    if not added:
        return
    values = _interpolating_values(OmegaConf.to_container(cfg, resolve=False)) + \
        _override_values([*overrides, *hydra_overrides])
    known = [k for k in _all_keys(cfg) if k.partition(".")[0] not in added]
    for key in added:
        if _read_by(key, values):
            continue
        leaves = difflib.get_close_matches(key, {k.rpartition(".")[2] for k in known}, n=2, cutoff=0.75)
        close = [k for k in known if k.rpartition(".")[2] in leaves][:3]  # max_steps: trainer.max_steps
        guess = f"did you mean {' or '.join(close)}?" if close else \
            f"the keys at the top: {', '.join(sorted(k for k in known if '.' not in k))}"
        raise ConfigError(key, OmegaConf.select(cfg, key), f"a key nothing reads: it would be ignored (remove the "
                          f"+{key}=...); {guess}")


def refuse_unread_top_keys_of_launch(cfg, config_name: str, overrides: list[str] | None = None) -> None:
    """refuse_unread_top_keys for a running Hydra job: its command line's overrides (or `overrides`, a resume's).
    Hydra's own settings are read from the command line as typed (Hydra keeps them resolved)."""
    from hydra.core.hydra_config import HydraConfig

    typed = [a for a in sys.argv[1:] if a.startswith(("hydra.", "hydra/", "++hydra.", "+hydra."))]
    refuse_unread_top_keys(cfg, config_name, list(HydraConfig.get().overrides.task) if overrides is None else
                           overrides, typed)


def run_with_key_hints(main, config_name: str):
    """Run a @hydra.main function. Hydra refuses an unknown key with exit code 1 (or raises its error itself under
    HYDRA_FULL_ERROR=1); then the misspelled keys of the command line are named. Exit code 1 also ends a job that
    failed after Hydra took its keys: the check then composes once more and finds every key. The exit is always
    Hydra's own."""
    try:
        main()
    except (SystemExit, Exception) as stop:
        if not isinstance(stop, SystemExit) or stop.code == 1:
            try:
                hints = unknown_key_hints(config_name, sys.argv[1:])
                for line in hints:
                    print(line, file=sys.stderr)
                if hints:  # Hydra's own advice, printed above, is the wrong one for a typo
                    print("hint: Hydra's 'To append to your config use +<key>=...' would add the misspelled key as "
                          "a new one, which nothing reads; correct the key instead", file=sys.stderr)
            except Exception:  # noqa: BLE001 - a hint must never hide the error it follows
                pass
        raise
