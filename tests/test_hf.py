"""Training-free SWA / SA / MoBA at prefill on HuggingFace models (hf/): tiny random Qwen3 and Llama from configs.

Needs the `hf` extra (transformers); skipped without it. No weights are downloaded.
"""

import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

from hf import load_hf_model, patch_model, unpatch_model  # noqa: E402
from hf.attention import sequence_layout  # noqa: E402
from kernels import default_band  # noqa: E402
from kernels.moba import moba_mask  # noqa: E402
from kernels.naive import band_mask  # noqa: E402
from model.permutation import PermutationSampler  # noqa: E402

V, N = 101, 24  # vocabulary, sequence length of most tests


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op thread (two threads only add sync overhead, badly so on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny(arch: str, vocab: int = V):
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
                  attn_implementation="sdpa")
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request):
    return _tiny(request.param)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1))


def _logits(model, ids, kind=None, window=None, attention_mask=None, **kw):
    if kind is None:
        unpatch_model(model, "sdpa")
    else:
        patch_model(model, kind, window, **kw)
    with torch.no_grad():
        return model(ids, attention_mask=attention_mask).logits


def _close(a, b):
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


# ---- a dense reference: the model's own eager attention with a per-layer boolean mask in original order ----------

_REFERENCE_MASK = {}


def _dense_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    allowed = _REFERENCE_MASK["fn"](module.layer_idx, query, key)  # [n, n] or [B, H, n, n], True = attend
    allowed = allowed if allowed.dim() == 4 else allowed[None, None]
    additive = torch.zeros(allowed.shape, dtype=query.dtype).masked_fill(~allowed, torch.finfo(query.dtype).min)
    return eager_attention_forward(module, query, key, value, additive, scaling=scaling, dropout=0.0)


AttentionInterface.register("test_dense_reference", _dense_reference)


def _reference_logits(model, ids, mask_fn):
    _REFERENCE_MASK["fn"] = mask_fn
    model.set_attn_implementation("test_dense_reference")
    with torch.no_grad():
        return model(ids).logits


def _sa_mask(seed, window):
    left, right = default_band(window, permuted=True)

    def fn(layer, query, key):
        n = query.shape[2]
        pi = PermutationSampler(eval_seed=seed).sample(layer, n, query.shape[0], training=False)
        slot_mask = band_mask(pi, left, right)  # [slot i, slot j]
        allowed = torch.zeros(n, n, dtype=torch.bool)
        allowed[pi[:, None], pi[None, :]] = slot_mask  # -> [token pi[i], token pi[j]]
        return allowed

    return fn


# ------------------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("kind,window", [("full", None), ("swa", N), ("swa", 4 * N), ("sa", 2 * N), ("moba", N),
                                         ("moba", 2 * N)])
def test_wide_window_reproduces_the_model(tiny, ids, kind, window):
    """w_eff covering the sequence = the model's own logits. (SA's band is symmetric around a slot: w >= 2n - 1;
    MoBA: blocks of w/2, top 2, so w >= n with w even.)"""
    _close(_logits(tiny, ids, kind, window), _logits(tiny, ids))


@pytest.mark.parametrize("kind", ["swa", "sa", "moba"])
def test_small_window_changes_the_logits(tiny, ids, kind):
    assert (_logits(tiny, ids, kind, 4) - _logits(tiny, ids)).abs().max() > 1e-2


def test_swa_matches_explicit_sliding_window_mask(tiny, ids):
    """SWA(w) = the model run through eager attention with an explicit 4D additive sliding-window mask."""
    w = 5
    t = torch.arange(N)
    allowed = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < w)
    additive = torch.zeros(1, 1, N, N).masked_fill(~allowed, torch.finfo(torch.float32).min).expand(2, 1, N, N)
    tiny.set_attn_implementation("eager")
    with torch.no_grad():
        ref = tiny(ids, attention_mask=additive).logits
    _close(_logits(tiny, ids, "swa", w), ref)


@pytest.mark.parametrize("window", [4, 7])
def test_sa_matches_its_dense_reference_and_is_deterministic(tiny, ids, window):
    out = _logits(tiny, ids, "sa", window, seed=3)
    _close(_logits(tiny, ids, "sa", window, seed=3), out)  # same seed: same pi per layer, same logits
    assert (_logits(tiny, ids, "sa", window, seed=4) - out).abs().max() > 1e-3  # another seed: another pi
    _close(_logits(tiny, ids, "sa", window, seed=3, backend="naive"), out)  # kernels.naive_banded_attention
    _close(_reference_logits(tiny, ids, _sa_mask(3, window)), out)  # eager attention with pi's mask per layer


@pytest.mark.parametrize("kind", ["full", "swa", "sa"])
def test_the_models_own_attention_scale_reaches_the_kernel(kind):
    """A model's `scaling` (Gemma's query_pre_attn_scalar, a muP scale) was not tested: every test model uses the
    kernels' default 1/sqrt(D), so dropping it passed."""
    from hf.attention import PrefillSettings, sa_prefill_attention
    from kernels.naive import naive_banded_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 16, generator=g) for h in (4, 2, 2))
    module = types.SimpleNamespace(sa_prefill=PrefillSettings(kind=kind, window=None if kind == "full" else 5, seed=2),
                                   layer_idx=1, is_causal=True, training=False, num_key_value_groups=2)
    out, _ = sa_prefill_attention(module, q, k, v, None, scaling=0.3)
    perm = PermutationSampler(eval_seed=2).sample(1, 24, 2, training=False) if kind == "sa" else None
    left, right = (23, 0) if kind == "full" else default_band(5, perm is not None)
    want = naive_banded_attention(q, k, v, left, right, perm, scale=0.3)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_moba_matches_its_dense_reference(tiny, ids):
    out = _logits(tiny, ids, "moba", 6)
    ref = _reference_logits(tiny, ids, lambda layer, q, k: moba_mask(q, k, 3, 2))
    _close(out, ref)


@pytest.mark.parametrize("kind", ["swa", "sa", "moba"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_does_not_change_a_sequence(tiny, ids, kind, side):
    """A short sequence padded in a batch scores as it does alone (SA: pi over its real tokens only)."""
    L = 15
    short = ids[1:, :L]
    padded = torch.full((1, N), 0, dtype=torch.long)
    mask = torch.zeros(2, N, dtype=torch.long)
    mask[0] = 1
    if side == "right":
        padded[0, :L], mask[1, :L] = short[0], 1
    else:
        padded[0, N - L:], mask[1, N - L:] = short[0], 1
    batch = torch.cat([ids[:1], padded])
    alone = _logits(tiny, short, kind, 4, seed=1)
    both = _logits(tiny, batch, kind, 4, seed=1, attention_mask=mask)
    real = slice(0, L) if side == "right" else slice(N - L, N)
    _close(both[1, real], alone[0])
    _close(both[0], _logits(tiny, ids[:1], kind, 4, seed=1)[0])
    patch_model(tiny, kind, 4, seed=1)
    with torch.inference_mode():  # as lm-eval and serving code run it: masks without a version counter
        _close(tiny(batch, attention_mask=mask).logits, both)


@pytest.mark.parametrize("kind", ["swa", "sa"])
def test_triton_backend_matches_torch(tiny, ids, kind):
    """The fused Triton kernels (interpreter on CPU) on HF's q/k/v layouts, with right padding."""
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    ref = _logits(tiny, ids, kind, 5, attention_mask=mask, backend="torch")
    _close(_logits(tiny, ids, kind, 5, attention_mask=mask, backend="triton"), ref)


def test_sequence_layout_reads_and_refuses_masks():
    pos = torch.arange(6)
    causal = pos[None, :] <= pos[:, None]
    valid = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    mask4d = (causal[None] & valid[:, None, :])[:, None]
    starts, lengths = sequence_layout(mask4d, 2, 6)
    assert starts.tolist() == [0, 0] and lengths == [4, 6]
    assert sequence_layout(mask4d[1:].expand(2, 1, 6, 6).clone(), 2, 6) == (None, None)  # no padding
    assert sequence_layout(None, 2, 6) == (None, None)
    # a hand-built mask that also hides the pad queries of a right-padded row reads the same
    hidden_pads = (causal[None] & valid[:, None, :] & valid[:, :, None])[:, None]
    assert sequence_layout(hidden_pads, 2, 6)[1] == [4, 6]
    # a mask buffer rewritten in place is read again, not served from the cache of the last mask
    buffer = mask4d.clone()
    assert sequence_layout(buffer, 2, 6)[1] == [4, 6]
    shorter = valid.clone()
    shorter[0, 2:] = False
    buffer.copy_((causal[None] & shorter[:, None, :])[:, None])
    assert sequence_layout(buffer, 2, 6)[1] == [2, 6]
    with torch.inference_mode():  # inference tensors have no version counter: still read (and cached)
        assert sequence_layout(mask4d.clone(), 2, 6)[1] == [4, 6]
    holes = torch.tensor([[1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="contiguous"):
        sequence_layout(holes, 1, 6)
    packed = causal.clone()
    packed[3:, :3] = False  # two documents in one row
    with pytest.raises(ValueError, match="causal"):
        sequence_layout(packed[None, None], 1, 6)


def test_unpatch_restores_the_models_own_attention(ids):
    model = _tiny("llama")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(ids).logits
    patch_model(model, "sa", 4)
    patch_model(model, "swa", 4)  # patched twice: still back to eager, not to the first patch's sa_prefill
    unpatch_model(model)
    assert model.config._attn_implementation == "eager"
    assert all(getattr(m, "sa_prefill", None) is None for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, atol=0, rtol=0)


def test_errors_are_clear(tiny, ids):
    with pytest.raises(ValueError, match="kind"):
        patch_model(tiny, "nsa", 8)
    with pytest.raises(ValueError, match="window"):
        patch_model(tiny, "sa", None)
    from hf.patch import register

    register()  # run alone (-k), no earlier test had registered the name and set_attn_implementation refused it
    fresh = _tiny("llama")
    fresh.set_attn_implementation("sa_prefill")  # registered, but the modules carry no settings
    with pytest.raises(RuntimeError, match="patch_model"), torch.no_grad():
        fresh(ids)


def test_a_model_that_cannot_be_loaded_gets_one_line(tmp_path):
    with pytest.raises(OSError, match=r"^could not load the HuggingFace model .*give a local model folder") as err:
        load_hf_model(str(tmp_path / "not-a-model"), "swa", 8)
    assert "\n" not in str(err.value)


def test_the_sweep_refuses_a_misspelled_task_before_loading_the_model(tmp_path, monkeypatch):
    """It loaded the model (minutes for an 8B one), then failed with a traceback naming the Hydra key eval.tasks."""
    import hf.patch
    from hf.lm_eval_runner import main

    monkeypatch.setattr(hf.patch, "load_hf_model", lambda *a, **k: pytest.fail("loaded before the tasks were checked"))
    with pytest.raises(SystemExit, match=r"^error: .*--tasks.*unknown task 'hellaswg'; did you mean 'hellaswag'"):
        main(["--model", str(tmp_path / "m"), "--tasks", "piqa,hellaswg", "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("kind", ["swa", "sa", "moba"])
def test_generation_prefill_patched_decode_full(tiny, ids, kind):
    prompt = ids[:, :12]
    unpatch_model(tiny, "sdpa")
    expected = tiny.generate(prompt, max_new_tokens=6, do_sample=False)
    patch_model(tiny, kind, 2 * 18)  # covers prompt + generated tokens: identical to the model
    assert torch.equal(tiny.generate(prompt, max_new_tokens=6, do_sample=False), expected)
    patch_model(tiny, kind, 3, seed=2)  # small window: runs; batch (left padded) = each prompt alone
    short = prompt[1:, 3:]
    batch = torch.cat([prompt[:1], torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    together = tiny.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(together[1, 12:], tiny.generate(short, max_new_tokens=6, do_sample=False)[0, 9:])


def test_generation_without_the_cache_is_refused(tiny, ids):
    """Without the KV cache every decoding step is a whole-sequence forward, which the patch took for a prefill:
    SA with a fresh pi at every step, where decoding is full attention."""
    patch_model(tiny, "sa", 3)
    with pytest.raises(ValueError, match="use_cache=False"):
        tiny.generate(ids[:, :12], max_new_tokens=2, do_sample=False, use_cache=False)
    import copy

    twin = copy.deepcopy(tiny)  # generates with its own weights, not through the original's bound method
    with torch.no_grad():
        twin.lm_head.weight.mul_(-1)
    assert not torch.equal(twin.generate(ids[:, :12], max_new_tokens=4, do_sample=False),
                           tiny.generate(ids[:, :12], max_new_tokens=4, do_sample=False))
    unpatch_model(tiny, "sdpa")
    tiny.generate(ids[:, :12], max_new_tokens=2, do_sample=False, use_cache=False)  # the model's own, unpatched


def test_generation_that_would_not_prefill_with_the_pattern_is_refused(tiny, ids):
    """A generation config given by position passed the use_cache check; a static cache or a chunked prefill ran the
    prompt with full attention (or the pattern on its first chunk only) under the patched kind's name."""
    from transformers import GenerationConfig

    prompt = ids[:, :12]
    patch_model(tiny, "sa", 3)
    with pytest.raises(ValueError, match="use_cache=False"):
        tiny.generate(prompt, GenerationConfig(use_cache=False, max_new_tokens=2))
    with pytest.raises(ValueError, match="static"):
        tiny.generate(prompt, max_new_tokens=2, do_sample=False, cache_implementation="static")
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        tiny.generate(prompt, max_new_tokens=2, do_sample=False, prefill_chunk_size=4)
    expected = tiny.generate(prompt, max_new_tokens=3, do_sample=False)
    own = tiny.generation_config.cache_implementation
    try:
        tiny.generation_config.cache_implementation = "static"  # the model's own config: a config given lacks it
        with pytest.raises(ValueError, match="static"):
            tiny.generate(prompt, GenerationConfig(max_new_tokens=2, do_sample=False))
        tiny.generation_config.cache_implementation = "hybrid"  # Gemma 3's: a dynamic cache in transformers 5
        assert torch.equal(tiny.generate(prompt, max_new_tokens=3, do_sample=False), expected)
    finally:
        tiny.generation_config.cache_implementation = own
    patch_model(tiny, "full")  # nothing is patched at prefill: the model generates as it would unpatched
    unpatched = tiny.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=False)
    assert torch.equal(unpatched, tiny.generate(prompt, max_new_tokens=3, do_sample=False))
    unpatch_model(tiny, "sdpa")


def test_an_offloaded_static_cache_is_refused_and_dtype_names_are_read_as_meant(ids):
    """transformers' other static cache ("offloaded_static") gives the prefill more keys than queries as "static"
    does: it ran the prompt with full attention under the patched kind's name. A torch dtype given as such was
    replaced by the checkpoint's own, and each alias must name its own dtype."""
    from hf.patch import _dtype

    model = patch_model(_tiny("llama"), "sa", 3)
    with pytest.raises(ValueError, match="static"):
        model.generate(ids[:, :12], max_new_tokens=2, do_sample=False, cache_implementation="offloaded_static")
    assert [_dtype(d) for d in ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32")] == [
        torch.bfloat16, torch.bfloat16, torch.float16, torch.float16, torch.float32, torch.float32]
    assert _dtype(torch.float16) is torch.float16 and _dtype(None) == _dtype("auto") == "auto"
    with pytest.raises(ValueError, match="dtype"):
        _dtype("half")


def test_unpatch_keeps_a_models_own_instance_generate(ids):
    model = _tiny("llama")
    own = types.MethodType(lambda self, *a, **k: "own", model)
    model.generate = own  # a hub repo's custom_generate, say
    patch_model(model, "sa", 4)
    assert model.generate() == "own"
    unpatch_model(model)
    assert vars(model).get("generate") is own


def test_a_model_with_its_own_attention_code_is_refused():
    """Bloom, Falcon, ... do not call transformers' AttentionInterface: the config switch took, the patched function
    never ran, and their full-attention scores were reported as SA."""
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=V, hidden_size=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="AttentionInterface"):
        patch_model(model, "sa", 3)


def test_patched_attention_runs_under_autocast(tiny, ids):
    """Under autocast RoPE's fp32 cos/sin make q and k fp32 while v stays bf16 (lm-eval's mixed_precision_dtype
    path)."""
    expected = _logits(tiny, ids, "sa", 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _logits(tiny, ids, "sa", 7)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert (got.float() - expected).abs().max() < 0.1 * expected.abs().max()


def test_a_model_sliding_window_longer_than_the_prompt_is_no_obstacle(ids):
    """Mistral's config carries sliding_window=4096 by default: on a shorter prompt it changes nothing."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           sliding_window=N + 8, attn_implementation="sdpa")
    model = MistralForCausalLM(config).eval()
    full = _logits(model, ids)
    assert torch.allclose(_logits(model, ids, "swa", N), full, atol=1e-5)  # a band as wide as the prompt
    model.config.sliding_window = N // 2  # a window that acts on this prompt is still refused
    unpatch_model(model, "sdpa")
    model = MistralForCausalLM(model.config).eval()
    with pytest.raises(NotImplementedError, match="sliding window"):
        _logits(model, ids, "swa", 4)


# ---------------------------------------------------------------------------------------------- lm-eval, load path


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny byte-level BPE tokenizer + a tiny Qwen3 of its vocabulary, saved like a hub checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = ("the cat dog sat on a mat red blue sky is sun hot cold water question answer yes no what color of "
             "grass green snow white fire").split()
    text = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(40)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<pad>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    model = _tiny("qwen3", vocab=tok.get_vocab_size())
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = [{"question": f"what color is the {a}", "choices": ["green", "white", "red", "blue"], "answer": i % 4}
            for i, a in enumerate(["grass", "snow", "fire", "sky", "sun", "water cold", "dog", "mat on the cat"])]
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, data


def _task(data):
    return {"task": "tiny_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_choice": "{{choices}}", "doc_to_target": "answer",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0}}


def test_load_hf_model_from_folder(saved_model):
    folder, _ = saved_model
    model, tokenizer = load_hf_model(str(folder), "sa", 8, seed=0, dtype="float32", device="cpu")
    assert model.config._attn_implementation == "sa_prefill" and model.sa_prefill.kind == "sa"
    enc = tokenizer(["the cat sat on the mat", "red sky"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**enc).logits
    assert out.shape[:2] == enc["input_ids"].shape and torch.isfinite(out).all()


def _loglikelihoods(results):
    return [resp[0] for sample in results["samples"]["tiny_mc"] for resp in sample["filtered_resps"]]


def test_lm_eval_runs_a_local_task_on_the_patched_model(saved_model):
    """lm-eval's HFLM on the patched model; SA scores do not depend on the batch (padding is masked for pi)."""
    from hf.lm_eval_runner import evaluate_hf, primary_scores

    folder, data = saved_model
    model, tokenizer = load_hf_model(str(folder), "full", None, dtype="float32", device="cpu")
    common = dict(limit=None, device="cpu", seed=0, model=model, tokenizer=tokenizer, bootstrap_iters=0,
                  log_samples=True)
    sa1 = evaluate_hf(str(folder), "sa", 4, [_task(data)], batch_size=1, **common)
    sa8 = evaluate_hf(str(folder), "sa", 4, [_task(data)], batch_size=8, **common)
    assert sa1["sa_prefill"]["kind"] == "sa" and sa1["sa_prefill"]["window"] == 4
    assert 0.0 <= primary_scores(sa1)["tiny_mc"] <= 100.0 and len(_loglikelihoods(sa1)) == 32
    assert _loglikelihoods(sa8) == pytest.approx(_loglikelihoods(sa1), abs=1e-4)  # right-padded batches of 8
    full = _loglikelihoods(evaluate_hf(str(folder), "full", None, [_task(data)], batch_size=8, **common))
    assert full != pytest.approx(_loglikelihoods(sa1), abs=1e-2)
    moba = evaluate_hf(str(folder), "moba", 64, [_task(data)], batch_size=8, **common)  # 2 blocks >= prompt: full
    assert _loglikelihoods(moba) == pytest.approx(full, abs=1e-4)


def test_requests_whose_context_hflm_cuts_are_counted(saved_model):
    """HFLM keeps the last max_length tokens of a request and warns per request; results say how many were cut, as
    the native path's do."""
    from hf.lm_eval_runner import evaluate_hf

    folder, data = saved_model
    model, tokenizer = load_hf_model(str(folder), "full", None, dtype="float32", device="cpu")
    common = dict(limit=4, device="cpu", model=model, tokenizer=tokenizer, bootstrap_iters=0)
    assert evaluate_hf(str(folder), "full", None, [_task(data)], **common)["contexts_cut"] is None
    prompt = len(tokenizer("Question: what color is the grass\nAnswer:")["input_ids"])
    short = evaluate_hf(str(folder), "full", None, [_task(data)], max_length=prompt - 2, **common)
    assert short["contexts_cut"] == {"requests": 16, "of": 16, "to": prompt - 2}  # 4 questions x 4 choices
    # a rolling perplexity's windows are never cut and are not requests (WikiText made 5 of 5 read 5 of 792)
    from lm_eval.api.instance import Instance

    from hf.lm_eval_runner import make_lm

    lm = make_lm(model, tokenizer, batch_size=2, max_length=4)
    text = "the cat sat on the mat and the dog sat on the rug"
    assert len(tokenizer(text)["input_ids"]) > 2 * 4  # several windows
    lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert lm.requests_scored == lm.contexts_cut == 0


def test_a_resumed_sweep_reruns_a_configuration_whose_settings_changed(saved_model, tmp_path):
    """Resumable: a finished configuration is kept, but one scored on --limit 4 was kept for a run on every example."""
    from hf.lm_eval_runner import sweep

    folder, data = saved_model
    common = dict(device="cpu", dtype="float32", seed=0, bootstrap_iters=0)
    first = sweep(str(folder), ["sa"], [4], [_task(data)], tmp_path, limit=4, **common)
    saved = tmp_path / "sa_w4.json"
    stamp = saved.stat().st_mtime_ns
    assert sweep(str(folder), ["sa"], [4], [_task(data)], tmp_path, limit=4, **common) == first
    assert saved.stat().st_mtime_ns == stamp  # the same settings: read back, not run again
    sweep(str(folder), ["sa"], [4], [_task(data)], tmp_path, limit=None, **common)
    results = json.loads(saved.read_text())
    assert results["sweep_settings"]["limit"] is None and results["n-samples"]["tiny_mc"]["effective"] == 8
    # written before the settings were recorded: judged by lm-eval's own record (its limit, the tasks it scored)
    results.pop("sweep_settings")
    saved.write_text(json.dumps(results))
    stamp = saved.stat().st_mtime_ns
    sweep(str(folder), ["sa"], [4], [_task(data)], tmp_path, limit=None, **common)
    assert saved.stat().st_mtime_ns == stamp
    sweep(str(folder), ["sa"], [4], [_task(data)], tmp_path, limit=4, **common)
    assert json.loads(saved.read_text())["sweep_settings"]["limit"] == 4
    stamp = saved.stat().st_mtime_ns
    sweep(str(folder) + "/", ["sa"], [4], [_task(data)], tmp_path, limit=4, **common)  # the same folder
    assert saved.stat().st_mtime_ns == stamp
    # another model's sweep into the same folder read the first model's scores back under the new name
    other = shutil.copytree(folder, tmp_path / "other_model")
    sweep(str(other), ["sa"], [4], [_task(data)], tmp_path, limit=4, **common)
    assert saved.stat().st_mtime_ns != stamp and json.loads(saved.read_text())["model"] == str(other)


def test_the_sweep_refuses_a_bad_kind_or_window_before_loading_the_model(tmp_path, monkeypatch):
    """--kinds full,swa,SA failed with a traceback after full and every SWA window had been scored (hours)."""
    import hf.patch
    from hf.lm_eval_runner import main

    monkeypatch.setattr(hf.patch, "load_hf_model", lambda *a, **k: pytest.fail("loaded before the kinds were checked"))
    common = ["--model", str(tmp_path / "m"), "--tasks", "piqa", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match=r"^error: invalid config: --kinds/--windows='SA w=16': kind must be"):
        main(common + ["--kinds", "full,swa,SA", "--windows", "16"])
    with pytest.raises(SystemExit, match=r"^error: invalid config: --windows='16,x'"):
        main(common + ["--windows", "16,x"])
    with pytest.raises(SystemExit, match=r"needs window \(w_eff\) >= 1"):
        main(common + ["--kinds", "sa", "--windows", "0"])


def test_the_tokenizer_loads_from_where_the_model_does(saved_model, tmp_path, monkeypatch):
    """cache_dir / token / local_files_only reached the model only: the tokenizer then looked on the hub, after the
    model had loaded (minutes for an 8B one)."""
    import transformers

    folder, _ = saved_model
    real, seen = transformers.AutoTokenizer.from_pretrained, []

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    load_hf_model(str(folder), "sa", 8, dtype="float32", device="cpu", cache_dir=str(tmp_path), local_files_only=True,
                  revision="main")
    assert seen == [{"cache_dir": str(tmp_path), "local_files_only": True, "revision": "main"}]


def test_hf_package_does_not_import_transformers():
    import subprocess
    import sys

    code = ("import sys; sys.modules['transformers'] = None; import hf, hf.attention, hf.patch, hf.lm_eval_runner; "
            "assert hf.PrefillSettings('sa', 8).window == 8")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("conftest").ROOT))


def test_evaluate_py_runs_a_patched_hf_model_offline(saved_model, tmp_path):
    """The command of the issue: evaluate.py model.hf=<local dir> attention=sa attention.window=... eval=quick."""
    import subprocess
    import sys

    from test_evaluation import make_truth, wiki_articles, write_evaldata

    evaldata = write_evaldata(tmp_path / "evaldata", make_truth(), wiki_articles(2))
    (tmp_path / "out" / "lm_eval").mkdir(parents=True)
    (tmp_path / "out" / "lm_eval" / "seed2.json").write_text("{}")  # an earlier 3-seed evaluation into this out_dir
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, str(root / "evaluate.py"), f"model.hf={saved_model[0]}", "attention=sa",
         "attention.window=8", "eval=quick", f"eval.data_dir={evaldata}", "eval.limit=3", "eval.device=cpu",
         "eval.num_seeds=2",
         f"eval.task_dir={tmp_path / 'tasks'}", f"out_dir={tmp_path / 'out'}"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["sa_prefill"]["kind"] == "sa" and results["sa_prefill"]["window"] == 8
    assert "lambada_openai" in results["results"] and "wikitext" in results["results"]
    # two SA seeds: each scored, and they differ (another pi per seed); the table shows mean and spread
    assert results["seeds"] == [0, 1] and len(results["scores_per_seed"]) == 2
    assert sorted(p.name for p in (tmp_path / "out" / "lm_eval").iterdir()) == ["seed0.json", "seed1.json"]
    first, second = results["scores_per_seed"]
    assert first["lambada_openai/perplexity"] != second["lambada_openai/perplexity"]
    table = (tmp_path / "out" / "results.md").read_text().splitlines()
    assert "±" in table[2] and table[0].count("|") == table[1].count("|") == table[2].count("|")  # one row, whole
    assert table[0] == ("| model | attention | w_eff | lambada_openai acc % | wikitext word_perplexity | "
                        "lambada_openai perplexity |")


def test_evaluate_py_fails_when_every_task_of_an_hf_run_is_skipped(saved_model, tmp_path):
    import subprocess
    import sys

    empty = tmp_path / "empty"
    empty.mkdir()  # no task's files: every task is skipped
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, str(root / "evaluate.py"), f"model.hf={saved_model[0]}", "attention=sa",
         "attention.window=8", "eval=quick", f"eval.data_dir={empty}", "eval.device=cpu",
         f"eval.task_dir={tmp_path / 'tasks'}", f"out_dir={tmp_path / 'out'}"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 1 and "nothing was evaluated" in res.stderr, res.stderr[-3000:]
    skipped = json.loads((tmp_path / "out" / "results.json").read_text())["skipped"]
    assert {"wikitext", "lambada_openai"} <= set(skipped)


def _evaldata(tmp_path):
    from test_evaluation import make_truth, wiki_articles, write_evaldata

    return write_evaldata(tmp_path / "evaldata", make_truth(), wiki_articles(2))


def _eval_cfg(overrides: list[str]) -> dict:
    """The eval section of conf/evaluate.yaml, composed as the command line would (conf/eval/quick.yaml defaults)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from conftest import ROOT

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return OmegaConf.to_container(compose(config_name="evaluate", overrides=overrides).eval, resolve=True)


def _evaluate_hf_model(*args):
    """evaluate.py's model.hf branch, in this process (`import evaluate` would find the HF `evaluate` package)."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("evaluate_py", ROOT / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.evaluate_hf_model(*args)


def test_evaluate_py_hf_uses_eval_task_dir_and_the_models_own_dtype(saved_model, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("SA_CACHE_DIR", str(tmp_path / "default_cache"))
    folder = tmp_path / "bf16_model"  # saved in bf16, as most hub LLMs are
    AutoModelForCausalLM.from_pretrained(saved_model[0], dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(saved_model[0]).save_pretrained(folder)
    common = [f"model.hf={folder}", "eval.tasks=[lambada_openai]", f"eval.data_dir={_evaldata(tmp_path)}",
              "eval.limit=2", "eval.device=cpu", f"eval.task_dir={tmp_path / 'tasks'}"]
    _evaluate_hf_model(str(folder), _eval_cfg(common), {}, tmp_path / "auto")
    assert (tmp_path / "tasks" / "lambada_openai.yaml").is_file() and not (tmp_path / "default_cache").exists()
    assert json.loads((tmp_path / "auto" / "results.json").read_text())["dtype"] == "bfloat16"
    _evaluate_hf_model(str(folder), _eval_cfg(common + ["eval.dtype=float32"]), {}, tmp_path / "fp32")
    assert json.loads((tmp_path / "fp32" / "results.json").read_text())["dtype"] == "float32"


def test_evaluate_py_hf_table_has_a_column_per_suite_task_not_per_subject(saved_model, tmp_path):
    cfg = _eval_cfg([f"model.hf={saved_model[0]}", "eval.tasks=[mmlu]", f"eval.data_dir={_evaldata(tmp_path)}",
                     "eval.limit=1", "eval.device=cpu", f"eval.task_dir={tmp_path / 'tasks'}"])
    _evaluate_hf_model(str(saved_model[0]), cfg, {}, tmp_path / "out")
    assert (tmp_path / "out" / "results.md").read_text().splitlines()[0] == "| model | attention | w_eff | mmlu acc % |"
    assert "mmlu_anatomy" in json.loads((tmp_path / "out" / "results.json").read_text())["scores_per_seed"][0]


def test_evaluate_hf_refuses_few_shot_examples_from_a_test_split(saved_model, tmp_path, monkeypatch):
    from hf.lm_eval_runner import evaluate_hf
    from model.config import ConfigError

    monkeypatch.setenv("SA_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="piqa have no non-test split") as err:
        evaluate_hf(str(saved_model[0]), "full", None, ["piqa"], data_dir=_evaldata(tmp_path), num_fewshot=2,
                    limit=1, device="cpu", dtype="float32", bootstrap_iters=0)
    assert err.value.key == "num_fewshot"


# ---------------------------------------------------------------------------------------------- export
def test_an_exported_checkpoint_gives_the_trained_models_logits(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """Llama's architecture is the decoder's: full attention as it is, SA through the prefill patch."""
    from hf.export import export, main
    from model.checkpoint import load_checkpoint

    out = export(tiny_ckpt, tmp_path / "export")
    assert json.loads((out / "sa_export.json").read_text())["attention"] == {"kind": "sa", "window": 8, "eval_seed": 0}
    monkeypatch.chdir(tiny_ckpt.parent)  # exported from a relative path, recorded as an absolute one
    moved = export(Path(tiny_ckpt.name), tmp_path / "export_relative")
    assert json.loads((moved / "sa_export.json").read_text())["checkpoint"] == str(tiny_ckpt.resolve())
    ours = load_checkpoint(tiny_ckpt)
    tokens = torch.tensor([ours.tokenizer.encode("The value of the first argument is returned.").ids])
    for kind in ("full", "sa"):
        model, tokenizer = load_hf_model(str(out), kind=kind, window=8, dtype="float32", device="cpu")
        assert tokenizer(" value").input_ids == ours.tokenizer.encode(" value").ids
        literal = "the end <|endoftext|> of text"  # text, as in the shards, not the EOS token
        assert tokenizer(literal).input_ids == ours.tokenizer.encode(literal).ids
        assert ours.eos_id not in tokenizer(literal).input_ids
        reference = load_checkpoint(tiny_ckpt, attention={"kind": kind}).model
        with torch.no_grad():
            assert torch.allclose(model(tokens).logits, reference(tokens), atol=1e-5), kind
    plain = LlamaForCausalLM.from_pretrained(out).eval()  # no patch: full attention, transformers alone
    with torch.no_grad():
        ours = load_checkpoint(tiny_ckpt, attention={"kind": "full"}).model(tokens)
        assert torch.allclose(plain(tokens).logits, ours, atol=1e-5)
    with pytest.raises(SystemExit, match="exists"):
        main([f"ckpt={tiny_ckpt}", f"out={out}"])
    from evaluate import exported_attention

    trained = {"eval_seed": 0}
    assert exported_attention(str(out), {}) == {"kind": "sa", "window": 8, **trained}  # model.hf=<out>: as trained
    capsys.readouterr()
    assert exported_attention(str(out), {"window": 16}) == {"kind": "sa", "window": 16, **trained}
    assert f"attention sa (w=16), {out} was trained with w=8" in capsys.readouterr().err  # not "as trained"
    from evaluate import _trained_label

    assert _trained_label(str(out), "sa", 16) == " [trained sa (w=8)]" and _trained_label(str(out), "sa", 8) == ""
    assert _trained_label(str(out), "full", None) == " [trained sa (w=8)]"
    assert exported_attention(str(out), {"kind": "full"}) == {"kind": "full", **trained}
    assert exported_attention(str(out), {"kind": "swa"}) == {"kind": "swa", "window": 8, **trained}  # trained window
    assert exported_attention(str(out), {"eval_seed": 3}) == {"kind": "sa", "window": 8, "eval_seed": 3}
    with pytest.raises(ValueError, match="needs window"):  # before the model loads (a folder that is none here)
        load_hf_model(str(tmp_path / "no_model_here"), kind="sa", window=None)


def test_llama_names_and_config_carry_every_setting_of_the_decoder():
    """The tiny checkpoint the export test uses has tied embeddings, RoPE base 10000 and norm eps 1e-6, Llama's own
    defaults: a dropped rope_theta or rms_norm_eps, an untied lm_head mapped wrongly, swapped norms or SwiGLU halves
    would pass there. Here every setting differs from those defaults and every weight from its init."""
    from hf.export import llama_config, llama_name
    from model.config import AttentionConfig, ModelConfig
    from model.decoder import Decoder

    cfg = ModelConfig(vocab_size=V, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=64,
                      rope_theta=500.0, norm_eps=1e-2, tie_embeddings=False)
    ours = Decoder(cfg, AttentionConfig(kind="full", window=64, backend="torch")).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))  # norms away from 1, lm_head away from the embedding
    llama = LlamaForCausalLM(llama_config(cfg, eos_id=0)).eval()
    missing, unexpected = llama.load_state_dict({llama_name(k): v for k, v in ours.state_dict().items()}, strict=False)
    assert not missing and not unexpected
    assert not torch.equal(llama.lm_head.weight, llama.model.embed_tokens.weight)
    tokens = torch.randint(0, V, (2, 40), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(llama(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-4)


def test_an_export_keeps_the_eval_seed_of_its_sa_permutations(tiny_ckpt, tmp_path):
    """An SA model trained with attention.eval_seed=5 scores with π from (5, layer); its export scored with seed 0
    (load_hf_model's default, and what evaluate.py model.hf=<export> used) is another model."""
    from evaluate import exported_attention
    from hf.export import export
    from model.checkpoint import load_checkpoint

    ckpt = torch.load(tiny_ckpt, map_location="cpu", weights_only=True)
    ckpt["hyper_parameters"]["attention"]["eval_seed"] = 5
    torch.save(ckpt, tmp_path / "seed5.ckpt")
    out = export(tmp_path / "seed5.ckpt", tmp_path / "export")
    attention = exported_attention(str(out), {})
    assert attention == {"kind": "sa", "window": 8, "eval_seed": 5}
    preset = {"kind": "sa", "window": 32, "backend": "auto", "eval_seed": 0}  # what `attention=sa` composes
    assert exported_attention(str(out), preset, given={"kind"}) == {**preset, "window": 8, "eval_seed": 5}
    assert exported_attention(str(out), preset, given={"kind", "window"}) == {**preset, "eval_seed": 5}
    import subprocess
    import sys

    empty = tmp_path / "empty"
    empty.mkdir()  # no task data: stops after the attention settings are read, before the model loads
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "evaluate.py"), f"model.hf={out}", "attention=sa",
                          f"eval.data_dir={empty}", f"out_dir={tmp_path / 'out'}"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 1 and "nothing was evaluated" in res.stderr, res.stderr[-2000:]
    assert "eval: SA eval seed 5, as" in res.stderr and "eval: window 8, as" in res.stderr  # not the preset's 0 / 32
    ours = load_checkpoint(tmp_path / "seed5.ckpt").model
    tokens = torch.randint(0, ours.cfg.vocab_size, (1, 40))
    model, _ = load_hf_model(str(out), kind="sa", window=8, seed=attention["eval_seed"], dtype="float32",
                             device="cpu")
    other, _ = load_hf_model(str(out), kind="sa", window=8, seed=0, dtype="float32", device="cpu")
    with torch.no_grad():
        assert torch.allclose(model(tokens).logits, ours(tokens), atol=1e-5)
        assert not torch.allclose(other(tokens).logits, ours(tokens), atol=1e-3)


def test_gated_checkpoints_are_not_exported(tmp_path, corpus_file, data_cache):
    from conftest import TINY, compose_train
    from hf.export import export
    from model.config import ConfigError
    from train import train

    train(compose_train(TINY + ["attention=gated_sa_swa", "attention.window=8", "trainer.max_steps=1"], tmp_path,
                        corpus_file, data_cache))
    with pytest.raises(ConfigError, match="gates"):
        export(tmp_path, tmp_path / "export")
    assert not (tmp_path / "export").exists() and not list(tmp_path.glob(".export.*"))


def test_evaluate_py_hf_runs_one_sa_seed_when_the_band_spans_every_request(saved_model, tmp_path, capsys):
    from model.config import AttentionConfig

    context, window = 32, 64
    assert AttentionConfig(kind="sa", window=window).sees_every_earlier_token(context)
    cfg = _eval_cfg([f"model.hf={saved_model[0]}", "eval.tasks=[lambada_openai]", "eval.limit=2", "eval.device=cpu",
                     f"eval.data_dir={_evaldata(tmp_path)}", f"eval.task_dir={tmp_path / 'tasks'}",
                     "eval.num_seeds=3", f"eval.max_length={context}"])
    _evaluate_hf_model(str(saved_model[0]), cfg, {"kind": "sa", "window": window}, tmp_path / "out")
    assert "every query sees every earlier token, so sa scores as full causal attention here: 1 seed instead of 3" \
        in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "results.json").read_text())["seeds"] == [0]
    cfg["num_seeds"] = 1  # said for one seed and for SWA too, as for checkpoints
    _evaluate_hf_model(str(saved_model[0]), cfg, {"kind": "swa", "window": context}, tmp_path / "swa")
    assert "every query sees every earlier token, so swa scores as full causal attention here\n" \
        in capsys.readouterr().err
