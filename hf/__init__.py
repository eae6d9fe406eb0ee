"""Training-free SWA / SA / MoBA at prefill on pretrained HuggingFace causal LMs (docs/method.md, paper section 6).

    from hf import load_hf_model, patch_model, evaluate_hf
    model, tokenizer = load_hf_model("Qwen/Qwen3-8B", kind="sa", window=128, dtype="bfloat16")
    patch_model(model, kind="swa", window=64)            # switch pattern / window in place
    evaluate_hf("Qwen/Qwen3-8B", "moba", 256, ["boolq"], batch_size=16, limit=None, device="cuda", seed=0)

hf.attention        the attention function registered as attn_implementation "sa_prefill" (+ PrefillSettings)
hf.patch            register(), patch_model(), unpatch_model(), load_hf_model()
hf.lm_eval_runner   evaluate_hf(): lm-eval's HFLM on a patched model

Needs the `hf` extra (pip install -e ".[hf]": transformers, accelerate); importing this package does not import
transformers (only the functions that need it do).
"""

from hf.attention import ATTN_NAME, KINDS, PrefillSettings
from hf.patch import load_hf_model, patch_model, register, unpatch_model


def evaluate_hf(*args, **kwargs):
    """See hf.lm_eval_runner.evaluate_hf."""
    from hf.lm_eval_runner import evaluate_hf as _evaluate_hf

    return _evaluate_hf(*args, **kwargs)


__all__ = ["ATTN_NAME", "KINDS", "PrefillSettings", "evaluate_hf", "load_hf_model", "patch_model", "register",
           "unpatch_model"]
