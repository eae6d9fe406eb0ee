"""Switch a HuggingFace causal LM to SWA / SA / MoBA at prefill without touching its weights or its model files.

    from hf import load_hf_model, patch_model
    model, tok = load_hf_model("Qwen/Qwen3-8B", kind="sa", window=128, seed=0, dtype="bfloat16")
    patch_model(model, kind="moba", window=256)     # re-patch in place (any kind, any window)
    unpatch_model(model)                            # back to the implementation it had before

The attention function is registered in transformers' AttentionInterface (and transformers' sdpa mask builder in
AttentionMaskInterface) under the name "sa_prefill"; the model's config selects it (model.set_attn_implementation).
Works for every model whose attention layers go through the AttentionInterface and carry `layer_idx` (Llama, Qwen2,
Qwen3, Qwen3-MoE, Mistral without sliding window, ...).
"""

from __future__ import annotations

import inspect
import types

from hf.attention import ATTN_NAME, PrefillSettings, sa_prefill_attention


def register(name: str = ATTN_NAME) -> None:
    """Register sa_prefill_attention (and the sdpa mask builder, so padding reaches it) under `name`. Idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, sa_prefill_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # pragma: no cover - transformers without masking_utils: masks arrive as built by the model
        return
    AttentionMaskInterface.register(name, sdpa_mask)


def _set_attn_implementation(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(name)
        except (ValueError, KeyError, ImportError):  # pragma: no cover - older versions validate names strictly
            pass
    if getattr(model.config, "_attn_implementation", None) != name:  # e.g. remote-code models: set it directly
        model.config._attn_implementation = name
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and config is not model.config and hasattr(config, "_attn_implementation"):
                config._attn_implementation = name


def patch_model(model, kind: str, window: int | None = None, seed: int = 0, backend: str = "auto",
                moba_top_k: int = 2):
    """Make `model` use `kind` (full | swa | sa | moba) with w_eff=`window` at prefill; decoding stays full.

    Stores a PrefillSettings on every attention module (the modules with `layer_idx`) and on the model
    (`model.sa_prefill`), registers the attention function and selects it. Returns the model (patched in place).
    """
    if not getattr(model, "_supports_attention_backend", False):
        # its attention layers call their own code: the config switch below would take, the patched function never
        # run, and the scores of the model's full attention be reported as SA / SWA / MoBA
        raise ValueError(f"{type(model).__name__} does not run its attention through transformers' "
                         "AttentionInterface (_supports_attention_backend is False), so it cannot be patched; "
                         "supported: Llama, Qwen2/3, Mistral, Gemma, Phi, GPT-NeoX and other such models")
    settings = PrefillSettings(kind=kind, window=None if window is None else int(window), seed=int(seed),
                               backend=backend, moba_top_k=int(moba_top_k))
    register()
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    if not layers:
        layers = [m for m in model.modules() if hasattr(m, "layer_idx")]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no attention modules with `layer_idx` found; not supported")
    for module in layers:
        module.sa_prefill = settings
    model.sa_prefill = settings
    current = getattr(model.config, "_attn_implementation", None)
    if current != ATTN_NAME:  # re-patching keeps the implementation the model had before the first patch
        model._attn_before_sa_prefill = current or "sdpa"
    _set_attn_implementation(model, ATTN_NAME)
    if "generate" not in vars(model):  # an instance generate of its own (a hub repo's custom_generate) stays
        # bound to the instance (not wrapping its bound generate), so that a copy of the model generates with itself
        model.generate = types.MethodType(_generate_with_cache, model)
    return model


def _generate_with_cache(self, *args, **kwargs):
    """generate() of a patched model, with the KV cache required: without it every decoding step re-runs the whole
    sequence as a prefill, under the pattern and a fresh pi, where decoding is meant to be full attention. A static
    cache or a chunked prefill are refused too: the prompt would run full attention (or the pattern on its first
    chunk only) while the output is labelled with the patched kind."""
    settings = getattr(self, "sa_prefill", None)
    if settings is not None and settings.kind != "full":
        generate = type(self).generate
        try:  # generation_config may come by position too (generate(inputs, generation_config))
            given = inspect.signature(generate).bind_partial(self, *args, **kwargs).arguments
        except TypeError:  # let generate itself report the bad call
            given = {}
        extra = given.get("kwargs", kwargs)
        configs = [c for c in (given.get("generation_config"), getattr(self, "generation_config", None)) if c]

        def setting(name, default=None):  # as generate resolves it: keyword, the config given, the model's own
            if name in extra:
                return extra[name]
            return next((getattr(c, name) for c in configs if getattr(c, name, None) is not None), default)

        if setting("use_cache", True) is False:
            raise ValueError("hf.patch_model: generate(use_cache=False) would apply the prefill pattern to every "
                             "decoding step; generate with the cache (decoding is full attention over it)")
        # a static cache is allocated at full length: the prefill's queries meet more keys and run full attention
        # (hf.attention); "hybrid" (Gemma 3's config) is a dynamic cache in transformers 5
        if "static" in str(setting("cache_implementation") or ""):
            raise ValueError(f"hf.patch_model: generate(cache_implementation={setting('cache_implementation')!r}) "
                             f"would run the prompt with full attention, not {settings.kind}: a static cache gives "
                             "the prefill more keys than queries; use a dynamic cache (the default)")
        if setting("prefill_chunk_size") is not None:
            raise ValueError("hf.patch_model: a chunked prefill (prefill_chunk_size) would apply the pattern to the "
                             "first chunk only; prefill the prompt in one call")
    return type(self).generate(self, *args, **kwargs)


def unpatch_model(model, attn_implementation: str | None = None):
    """Back to the attention implementation the model had before `patch_model` (or `attn_implementation`)."""
    _set_attn_implementation(model, attn_implementation or getattr(model, "_attn_before_sa_prefill", "sdpa"))
    if getattr(vars(model).get("generate"), "__func__", None) is _generate_with_cache:  # not a model's own
        del model.generate
    for module in model.modules():
        if getattr(module, "sa_prefill", None) is not None:
            module.sa_prefill = None
    return model


def resolve_device(device: str | None) -> str:
    import torch

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def _dtype(dtype):
    import torch

    if dtype in (None, "auto") or isinstance(dtype, torch.dtype):
        return dtype or "auto"
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be auto or one of {sorted(names)}, got {dtype!r}")
    return names[dtype]


# from_pretrained arguments that say where the files are and may be read, for the tokenizer as for the model
_TOKENIZER_KWARGS = ("revision", "trust_remote_code", "cache_dir", "token", "local_files_only", "force_download",
                     "proxies")


def load_hf_model(name_or_path: str, kind: str = "full", window: int | None = None, seed: int = 0,
                  backend: str = "auto", dtype="auto", device: str | None = "auto", moba_top_k: int = 2,
                  **from_pretrained_kwargs):
    """(model, tokenizer): AutoModelForCausalLM + AutoTokenizer from a hub name or a local folder, patched, eval mode.

    dtype: auto (the checkpoint's) | float32 | bfloat16 | float16. device: auto (cuda if available) | cpu | cuda[:i].
    Extra keyword arguments go to from_pretrained (revision=, trust_remote_code=, ...).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # a kind without a window (or another bad setting) fails here, not after minutes of loading
    PrefillSettings(kind=kind, window=None if window is None else int(window), seed=int(seed), backend=backend,
                    moba_top_k=int(moba_top_k))
    register()
    try:  # the tokenizer first: a missing one fails before minutes of loading the model
        tokenizer = AutoTokenizer.from_pretrained(
            name_or_path, **{k: v for k, v in from_pretrained_kwargs.items() if k in _TOKENIZER_KWARGS})
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=_dtype(dtype), attn_implementation="sdpa",
                                                     **from_pretrained_kwargs)
    except (OSError, ValueError) as err:  # not cached and the hub unreachable, a folder that is not a model, ...
        if isinstance(err, ValueError) and type(err).__name__ != "HFValidationError":
            raise  # e.g. an architecture transformers cannot run with sdpa: its own message says it
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise OSError(f"could not load the HuggingFace model {name_or_path!r}: {first} -- give a local model folder, "
                      "or a hub name on a machine with hub access (or the model in its HF cache)") from None
    model.to(resolve_device(device)).eval()
    patch_model(model, kind, window, seed=seed, backend=backend, moba_top_k=moba_top_k)
    return model, tokenizer
