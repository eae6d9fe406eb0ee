"""Export a checkpoint of this repository as a HuggingFace Llama model folder: config.json, model.safetensors and
the tokenizer (tokenizer.json, tokenizer_config.json), plus sa_export.json naming the trained attention.

    python -m hf.export ckpt=runs/train/<run> out=exports/<name>

The decoder is Llama's architecture (RMSNorm, RoPE with the rotate-half convention, SwiGLU, GQA, optionally tied
embeddings), so only the parameter names change. Full attention loads as it is (transformers, vLLM, lm-eval's `hf`
model). SWA, SA and MoBA run through this repository's patch at prefill, which reproduces the trained model's
logits (tests/test_hf.py): `hf.load_hf_model(<out>, kind="sa", window=<w>, seed=<eval_seed>)`, or `python
evaluate.py model.hf=<out>`, which reads the trained attention and eval seed from sa_export.json. Gated SA+SWA has
gate parameters that Llama has no place for and is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# ours -> Llama's, inside each block
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
                "attn.o_proj": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
                "mlp.down": "mlp.down_proj"}


def llama_name(name: str) -> str:
    """A Decoder parameter name -> the LlamaForCausalLM one."""
    if name.startswith("blocks."):
        _, layer, rest = name.split(".", 2)
        module, param = rest.rsplit(".", 1)
        return f"model.layers.{layer}.{_BLOCK_NAMES[module]}.{param}"
    return {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}[name]


def llama_config(cfg, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
                       num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                       num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                       max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                       tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
                       hidden_act="silu", bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                       torch_dtype="float32")


def export(ckpt: str | Path, out: str | Path) -> Path:
    """Write the HF folder of checkpoint `ckpt` (a file or run directory) to `out`, which must not exist yet.
    The folder appears whole or not at all (written beside it, then renamed)."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from data.shards import _umask
    from model.checkpoint import load_checkpoint
    from model.config import ConfigError

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: give a new out=<folder>")
    loaded = load_checkpoint(ckpt)
    model, attn = loaded.model, loaded.model.attn_cfg
    if attn.kind == "gated_sa_swa":
        raise ConfigError("attention.kind", attn.kind, "gated SA+SWA has per-layer gates that a Llama model has no "
                          "place for; export a full, swa, sa or moba checkpoint")
    llama = LlamaForCausalLM(llama_config(model.cfg, loaded.eos_id))
    state = {llama_name(k): v for k, v in model.state_dict().items()
             if not (model.cfg.tie_embeddings and k == "lm_head.weight")}
    missing, unexpected = llama.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (model.cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"parameter names do not map onto Llama: missing {missing}, unexpected {unexpected}")
    eos = loaded.tokenizer.id_to_token(loaded.eos_id)
    # split_special_tokens (saved in tokenizer_config.json): a literal "<|endoftext|>" in text is text, as in the
    # shards the model trained on; tokenizers' own encode_special_tokens flag is not saved
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=loaded.tokenizer, eos_token=eos, bos_token=eos,
                                        pad_token=eos, model_max_length=model.cfg.max_seq_len,
                                        split_special_tokens=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        llama.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        meta = {"checkpoint": str(Path(loaded.checkpoint).resolve()), "step": loaded.step,
                # eval_seed: SA's evaluation permutations come from (eval_seed, layer), as in the trained model
                "attention": {"kind": attn.kind, "window": attn.window, "eval_seed": attn.eval_seed},
                "load": "full attention: as is; swa / sa / moba: hf.load_hf_model(folder, kind, window, seed=eval_seed)"
                        " or evaluate.py model.hf=<folder> (the attention above unless attention.* sets another)"}
        (tmp / "sa_export.json").write_text(json.dumps(meta, indent=1) + "\n")
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would hide the export from the rest of a team
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv=None) -> int:
    args = dict(arg.split("=", 1) for arg in (sys.argv[1:] if argv is None else argv) if "=" in arg)
    if not args.get("ckpt") or not args.get("out") or set(args) - {"ckpt", "out"}:
        raise SystemExit("usage: python -m hf.export ckpt=<run dir or .ckpt> out=<new folder>")
    from model.checkpoint import CheckpointError
    from model.config import ConfigError

    try:
        out = export(args["ckpt"], args["out"])
    except (ConfigError, CheckpointError, FileExistsError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None
    kind = json.loads((out / "sa_export.json").read_text())["attention"]
    print(f"wrote {out} (trained attention {kind['kind']}, window {kind['window']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
