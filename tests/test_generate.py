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
