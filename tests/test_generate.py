"""Sampling (model/generate.py): the draws' support under temperature / top-k / top-p, and greedy decoding equal to
re-scoring every prefix with the model."""

import pytest
import torch

from model.config import AttentionConfig, ModelConfig
from model.decoder import Decoder
from model.generate import generate, next_token


def test_greedy_and_cut_distributions():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]])).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits[:3], temperature=0).tolist() == [1, 1, 1]
    assert set(next_token(logits, top_k=1, generator=gen).tolist()) == {1}
    assert set(next_token(logits, top_k=2, generator=gen).tolist()) == {1, 3}
    assert set(next_token(logits, top_p=0.5, generator=gen).tolist()) == {1, 3}  # 0.4 < 0.5 <= 0.4 + 0.3
    assert set(next_token(logits, top_p=0.1, generator=gen).tolist()) == {1}  # the top token always stays
    drawn = next_token(logits, generator=gen)
    assert set(drawn.tolist()) == {0, 1, 2, 3}
    assert abs((drawn == 1).float().mean().item() - 0.4) < 0.05  # temperature 1: the model's own distribution
    cold = next_token(logits, temperature=0.25, generator=gen)
    assert (cold == 1).float().mean() > 0.6  # a low temperature sharpens it


def _model(kind):
    cfg = ModelConfig(vocab_size=40, n_layers=2, d_model=32, n_heads=2, max_seq_len=12)
    return Decoder(cfg, AttentionConfig(kind=kind, window=4, backend="torch"), seed=3).eval()


@pytest.mark.parametrize("kind", ["sa", "gated_sa_swa", "full"])
def test_greedy_generation_rescoring_every_prefix(kind):
    model = _model(kind)
    prompt = [5, 9, 2]
    out = generate(model, prompt, max_new_tokens=15, num_samples=2, temperature=0)  # past the 12-token context
    assert out[0] == out[1] and len(out[0]) == 15
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(15):
            seq.append(int(model(torch.tensor([seq[-12:]]))[0, -1].argmax()))
    assert out[0] == seq[3:]


def test_samples_stop_at_eos_and_follow_the_seed():
    model = _model("sa")
    draw = [generate(model, [1, 2], 10, num_samples=4, generator=torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert draw[0] == draw[1] and draw[0] != draw[2]
    greedy = generate(model, [1, 2], 10, temperature=0)[0]
    stopped = generate(model, [1, 2], 10, temperature=0, eos_id=greedy[3])[0]
    assert stopped == greedy[: greedy.index(greedy[3])]
    with pytest.raises(ValueError, match="no token"):
        generate(model, [], 3)


def test_a_training_model_is_given_back_training():
    model = _model("sa").train()
    assert generate(model, [1, 2], 3, temperature=0)[0] == generate(model.eval(), [1, 2], 3, temperature=0)[0]
    model.train()
    generate(model, [1, 2], 3)
    assert model.training  # else the rest of a run that sampled from a callback would train on eval-seed pi


def test_a_continuation_keeps_its_leading_space_under_a_sentencepiece_decoder():
    """Decoded alone, a Llama-2-style decoder (its Strip of one leading space) glued "of" + "the" into "ofthe"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from sample import continuation

    vocab = {"<unk>": 0, "▁The": 1, "▁history": 2, "▁of": 3, "▁the": 4, "▁world": 5}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    prompt = tok.encode("The history of", add_special_tokens=False).ids
    assert tok.decode([4, 5]) == "the world"  # the bug's cause: the leading space is stripped
    assert "The history of" + continuation(tok, prompt, [4, 5]) == "The history of the world"
    assert continuation(tok, prompt, []) == ""


def test_top_p_reads_the_mass_left_by_top_k_and_stops_once_it_is_reached():
    """top_p is taken over the top_k tokens renormalised (as transformers' warpers chain them): dropping top_p when
    top_k is set, or cutting on the full distribution, kept token 3 at top_k=2, top_p=0.5. A set whose mass equals
    top_p already reaches it: `>` for `>=` kept a second token of equal mass."""
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]])).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(next_token(logits, top_k=2, top_p=0.5, generator=gen).tolist()) == {1}  # 0.4 / 0.7 reaches 0.5
    assert set(next_token(logits, top_k=3, top_p=0.6, generator=gen).tolist()) == {1, 3}  # 0.4 / 0.9 does not
    tie = torch.zeros(2000, 2)  # probabilities 0.5 and 0.5, exact in floating point
    assert len(set(next_token(tie, top_p=0.5, generator=gen).tolist())) == 1


def test_each_sample_stops_at_its_own_eos_and_the_others_go_on():
    """One sample's EOS ended every sample (`done.any()`), or a finished sample went on collecting tokens past its
    EOS: each sample is its draw without eos_id, cut before its first eos_id (the draws are the same either way)."""
    model = _model("sa")
    free = generate(model, [1, 2], 10, num_samples=4, generator=torch.Generator().manual_seed(5))
    eos = free[2][3]
    assert any(eos not in s for s in free) and any(eos in s[:-1] for s in free)  # the case is discriminating
    stopped = generate(model, [1, 2], 10, num_samples=4, eos_id=eos, generator=torch.Generator().manual_seed(5))
    assert stopped == [s[: s.index(eos)] if eos in s else s for s in free]


def test_an_eval_model_is_given_back_in_eval_mode():
    """A model that came in eval mode left in training mode would draw training permutations at its next call."""
    model = _model("sa").eval()
    generate(model, [1, 2], 3, generator=torch.Generator().manual_seed(0))
    assert not model.training


def test_each_step_reads_exactly_the_last_max_seq_len_tokens():
    """A context one token short of max_seq_len (`-context + 1`) left greedy tokens of the tiny model unchanged, so
    the rescoring test passed: the inputs of every step are checked here."""
    model = _model("full")
    seen, real = [], model.hidden_states
    model.hidden_states = lambda tokens, *a, **kw: (seen.append(tokens.tolist()), real(tokens, *a, **kw))[1]
    out = generate(model, [5, 9, 2], max_new_tokens=15, num_samples=2, temperature=0)
    seq = [5, 9, 2] + out[0]
    assert seen == [[seq[:i][-12:]] * 2 for i in range(3, 18)]
