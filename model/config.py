"""Typed model/attention configs and their validation: every bad value is rejected here, before any work."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

ATTENTION_KINDS = ("full", "swa", "sa", "gated_sa_swa", "moba")
STOCHASTIC_KINDS = ("sa", "gated_sa_swa")  # drawing permutations: their eval scores depend on attention.eval_seed
BACKENDS = ("auto", "torch", "triton", "flex", "naive")
MOBA_TOP_K = 2  # MoBA as the paper compares it: each query's top-2 key blocks of w/2, about w keys


def moba_block_size(window: int) -> int:
    return max(1, int(window) // 2)


def attention_label(kind, window) -> str:
    """How tables and logs name an attention: `sa (w=32)`, or `full` (no window applies)."""
    return "full" if kind == "full" else f"{kind} (w={window})"


def attention_tag(kind, window, sep: str = "_") -> str:
    """How folder and run names carry an attention: `sa_w32` (sep "_"), `sa-w32` (sep "-"), or `full`."""
    return "full" if kind == "full" else f"{kind}{sep}w{window}"


def window_tag(kind, window) -> str:
    """The W&B tag of the window: `w32`, or "" (no tag) for full attention, which has none."""
    return "" if kind == "full" else f"w{window}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not a size


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, hint: str):
        super().__init__(f"invalid config: {key}={value!r}: {hint}")
        self.key = key


def attention_given(overrides) -> set[str]:
    """The attention.* keys a command line's overrides set (attention=<preset> sets kind), not a preset's defaults."""
    keys = {str(o).split("=", 1)[0].lstrip("+~") for o in overrides}
    given = {k.split(".", 1)[1] for k in keys if k.startswith("attention.")}
    return given | {"kind"} if "attention" in keys else given


def refuse_context_given(overrides, instead: str) -> None:
    """evaluate.py and sample.py keep a model.max_seq_len key only so that attention=full resolves (its window names
    it); the checkpoint's own context is used, so a value given on the command line would be ignored without a word.
    `instead`: what sets the context there."""
    for o in overrides:
        key, _, value = str(o).partition("=")
        if key.lstrip("+~") == "model.max_seq_len":
            raise ConfigError("model.max_seq_len", value, f"a checkpoint runs at the context it was trained with; "
                              f"{instead}")


def attention_from_command_line(attention: dict) -> dict:
    """The overrides of a trained model's attention in evaluate.py / sample.py's `attention` node: its set keys."""
    return {k: v for k, v in attention.items() if v is not None and k in ("kind", "window", "backend", "eval_seed")}


def trained_window_unless_given(attention: dict, given: set[str]) -> dict:
    """A trained model keeps its window and eval seed unless the command line sets them: `attention=sa` asks for SA,
    and the preset's window and eval_seed (32 and 0) are defaults for a model that has none, not a choice."""
    return {k: v for k, v in attention.items() if k in given or k not in ("window", "eval_seed")}


def check_window_for(trained_kind: str, kind: str, window_given: int | None, model: str) -> None:
    """A full-attention model records its context as its window (conf/attention/full.yaml's placeholder), not a
    choice: running it as SWA, SA or MoBA needs a window of its own. And a window given for a model that runs full
    attention would change nothing while the output folders and notes named it. `window_given`: the window the
    command line set, or None."""
    if trained_kind == "full" and kind != "full" and window_given is None:
        raise ConfigError("attention.window", None, f"{model} was trained with full attention, which has no window: "
                          f"give attention.window=<w> to run it as {kind}")
    if kind == "full" and window_given is not None:
        how = "was trained with full attention" if trained_kind == "full" else "runs full attention (attention.kind)"
        raise ConfigError("attention.window", window_given, f"{model} {how}, which has no window: give "
                          "attention=swa or attention=sa with the window to run it banded")


@dataclass
class AttentionConfig:
    kind: str = "full"
    window: int = 64  # band slots per query, including itself (docs/method.md)
    backend: str = "auto"
    eval_seed: int = 0  # SA permutations in eval mode come from (eval_seed, layer)
    per_sequence_perm: bool = True  # SA: an independent permutation for every sequence of the batch

    def __post_init__(self):
        if self.kind not in ATTENTION_KINDS:
            raise ConfigError("attention.kind", self.kind, f"choose one of {ATTENTION_KINDS}")
        if self.backend not in BACKENDS:
            raise ConfigError("attention.backend", self.backend, f"choose one of {BACKENDS}")
        if not _is_int(self.window) or self.window < 1:
            raise ConfigError("attention.window", self.window,
                              "the band holds w >= 1 slots (w counts the query itself)")
        if not _is_int(self.eval_seed):
            raise ConfigError("attention.eval_seed", self.eval_seed, "an integer (seeds SA's evaluation permutations)")
        if not isinstance(self.per_sequence_perm, bool):
            raise ConfigError("attention.per_sequence_perm", self.per_sequence_perm, "true or false")
        if self.kind == "moba" and self.window < 2:
            raise ConfigError("attention.window", self.window, f"MoBA takes the top-{MOBA_TOP_K} blocks of window/2 "
                              "keys, so window >= 2 (at 1 a query would see 2 keys)")

    def sees_every_earlier_token(self, n: int) -> bool:
        """Whether every query sees all earlier tokens at sequence length n: full causal attention in effect.

        A band (left, right) spans all n slots of every query once left >= n-1 and right >= n-1 (SWA: right 0
        keeps every later key out by position anyway); gated needs both of its paths; MoBA's top-k blocks cover the
        sequence once it has at most k blocks."""
        if self.kind == "full":
            return True
        if self.kind == "moba":
            return -(-n // moba_block_size(self.window)) <= MOBA_TOP_K
        from kernels import default_band

        left, right = default_band(self.window, permuted=self.kind != "swa")  # gated: SA's band is the narrower
        return left >= n - 1 and (self.kind == "swa" or right >= n - 1)

    def describe(self) -> str:
        """The log's one-line summary: the window and backend only where they apply."""
        if self.kind == "full":
            return "attention=full (" + ("the dense reference, backend=naive)" if self.backend == "naive" else
                                         "causal SDPA)")
        return f"attention={self.kind} window={self.window}" + (
            "" if self.kind == "moba" else f" backend={self.backend}")


@dataclass
class ModelConfig:
    vocab_size: int = 8192
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads
    ffn_hidden: int | None = None  # None = 8/3 * d_model rounded up to a multiple of 256 (Llama / FLA convention)
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self):
        for key in ("vocab_size", "n_layers", "d_model", "n_heads", "max_seq_len"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"model.{key}", value, "must be a positive integer")
        for key in ("n_kv_heads", "ffn_hidden"):
            value = getattr(self, key)
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(f"model.{key}", value, "a positive integer, or null for the default")
        for key in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, key)
            if not _is_number(value) or not 0 < value < float("inf"):
                raise ConfigError(f"model.{key}", value, "must be a positive (finite) number")
        if self.rope_theta <= 1:  # frequencies theta^(-2i/d) of 1 and above: positions repeat every few tokens
            raise ConfigError("model.rope_theta", self.rope_theta, "the RoPE base must exceed 1 (10000 is usual)")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError("model.tie_embeddings", self.tie_embeddings, "true or false")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("model.n_kv_heads", self.n_kv_heads,
                              f"must divide model.n_heads={self.n_heads} (each kv head serves a whole group)")
        if self.d_model % self.n_heads:
            raise ConfigError("model.d_model", self.d_model, f"must be divisible by model.n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError("model.d_model", self.d_model, "head dim (d_model / n_heads) must be even for RoPE")
        if self.ffn_hidden is None:
            self.ffn_hidden = 256 * -(-(8 * self.d_model // 3) // 256)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def from_mapping(cls, mapping, prefix: str):
    """Build a config dataclass from a (Hydra) mapping; unknown keys are an error that names them."""
    mapping = dict(mapping)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(mapping) - known - {"_target_"})
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}", mapping[unknown[0]], f"unknown key; known keys: {sorted(known)}")
    return cls(**{k: v for k, v in mapping.items() if k in known})
