"""The lm-evaluation-harness model class for our decoders: ``lm_eval --model sa-lm --model_args checkpoint=...``.

lm-eval 0.4.13 has no plugin / entry-point discovery for models: a model name resolves only if the module that
registers it has been imported. ``python -m evaluation.lm_eval_cli`` imports this module and then runs lm-eval's own
CLI; inside Python, ``import evaluation.lm`` is enough (or pass an ``SALM`` instance to ``lm_eval.simple_evaluate``).

Scoring conventions (same as lm-eval's HFLM):
* loglikelihood: context and continuation are tokenized together and split where the context's tokens end
  (TemplateLM._encode_pair); a context that encodes to no tokens is replaced by the EOS token. The model reads
  ``(context + continuation)[-(max_length + 1):][:-1]``: logits at position i predict token i + 1, so the last
  ``len(continuation)`` logits score the continuation, and a context too long for the model loses its left end.
  (A continuation longer than max_length, where HFLM refuses, is scored in consecutive max_length pieces.)
* loglikelihood_rolling: disjoint windows of ``max_length`` tokens (get_rolling_token_windows, context_len=1,
  make_disjoint_window), the first one conditioned on EOS.
* generate_until: greedy decoding, stops at any ``until`` string, at EOS, or after ``max_gen_toks`` tokens.
Batches are sorted by length and right-padded; ``lengths`` tells the model where each row ends, so padding never
changes a score (SA permutes only the real tokens).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

import lm_eval.models  # noqa: F401  (registers lm-eval's own models first: get_model() imports them only when empty)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

log = logging.getLogger(__name__)

MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | None) -> str:
    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():  # lm-eval's CLI defaults to --device cuda
        log.warning("sa-lm: device=%s but CUDA is not available; using cpu", device)
        return "cpu"
    return str(device)


def scored_request(key) -> bool:
    """Whether a loglikelihood request is one lm-eval asked for, not one of loglikelihood_rolling's windows (keyed
    None: they are never cut, and counting them made "contexts cut" read 5 of 792 for 5 of 5 prompts)."""
    return bool(key) and key[0] is not None


@register_model("sa-lm")
class SALM(TemplateLM):
    """Wraps a checkpoint of this repository (model/checkpoint.py) for lm-eval.

    model_args: checkpoint=<.ckpt or run dir> (required unless `loaded` is given), kind, window, backend, eval_seed
    (override the trained attention config), batch_size, device (auto|cpu|cuda[:i]), max_length (default: the
    trained context; longer evaluates past it, shorter in windows of that length), dtype (float32 | bfloat16 |
    float16; default float32; half precision runs as training's bf16-mixed did: fp32 weights, matmuls under
    autocast, so the model is never cast).
    """

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval import utils

        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        # lm-eval always adds its CLI's batch_size / device (defaults included) to model_args: a batch_size in
        # model_args, as the README writes it, was "got multiple values for keyword argument". model_args win.
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    def __init__(self, checkpoint: str | None = None, kind: str | None = None, window: int | None = None,
                 backend: str | None = None, eval_seed: int | None = None, batch_size: int | str = 16,
                 device: str | None = "auto", max_length: int | None = None, dtype: str = "float32",
                 loaded=None, **unused: Any):
        super().__init__()
        unused = {k: v for k, v in unused.items() if v is not None and k != "max_batch_size"}
        if unused:
            log.warning("sa-lm ignores model_args %s", sorted(unused))
        self._device = torch.device(resolve_device(device))
        if loaded is None:
            if not checkpoint:
                raise ValueError("sa-lm needs model_args checkpoint=<checkpoint file or run directory>")
            from model.checkpoint import load_checkpoint

            overrides = {k: v for k, v in dict(kind=kind, window=window, backend=backend, eval_seed=eval_seed).items()
                         if v is not None}
            overrides = {k: (v if k in ("kind", "backend") else int(v)) for k, v in overrides.items()}
            # a max_length past the trained context builds the model for it (RoPE extrapolation)
            longer = None if max_length in (None, "", "auto") or int(max_length) < 1 else int(max_length)
            loaded = load_checkpoint(checkpoint, attention=overrides or None, device=self._device, context=longer)
        elif any(v is not None for v in (checkpoint, kind, window, backend, eval_seed)):
            raise ValueError("give either `loaded` or checkpoint/attention arguments, not both")
        self.loaded = loaded
        self.model = loaded.model.to(self._device).eval()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.dtype = DTYPES[dtype]
        self.tokenizer = loaded.tokenizer
        self._eot = int(loaded.eos_id)
        context = int(self.model.cfg.max_seq_len)
        self._max_length = context if max_length in (None, "", "auto") else int(max_length)
        if not 1 <= self._max_length <= context:
            raise ValueError(f"max_length={max_length} must be in [1, {context}] (the model's max_seq_len)")
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            log.warning("sa-lm has no automatic batch size; using 16")
            batch_size = 16
        self.batch_size = max(1, int(batch_size))
        # loglikelihood requests scored, and those whose context lost its left end to max_length (a few-shot
        # prompt longer than the context loses its first examples): evaluation.runner says how many
        self.requests_scored = self.contexts_cut = 0

    # ------------------------------------------------------------------ properties lm-eval reads
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        from data.tokenizer import tokenizer_hash

        return f"sa-lm-bpe-{tokenizer_hash(self.tokenizer)}"

    @property
    def eval_seed(self) -> int:
        return int(self.model.sampler.eval_seed)

    @eval_seed.setter
    def eval_seed(self, seed: int):
        self.model.sampler.eval_seed = int(seed)

    def get_model_info(self) -> dict:
        attn = self.model.attn_cfg
        return {"checkpoint": str(self.loaded.checkpoint), "attention": {
            "kind": attn.kind, "window": attn.window, "backend": attn.backend, "eval_seed": self.eval_seed},
            "max_length": self.max_length, "dtype": str(self.dtype).removeprefix("torch."),
            "n_parameters": self.model.num_parameters()}

    # ------------------------------------------------------------------ tokenizer
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    # ------------------------------------------------------------------ model calls
    def _batch(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad `rows` into one batch on the device: (tokens [B, n], lengths [B])."""
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        tokens = torch.full((len(rows), int(lengths.max())), self._eot, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return tokens.to(self._device), lengths.to(self._device)

    def _precision(self):
        return torch.autocast(self._device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    @torch.no_grad()
    def _last_logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits [B, V] of the last real position of each row (the next-token distribution)."""
        tokens, lengths = self._batch(rows)
        with self._precision():
            hidden = self.model.hidden_states(tokens, lengths)
            return self.model.lm_head(hidden[torch.arange(len(rows), device=hidden.device), lengths - 1]).float()

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: [(key, context_enc, continuation_enc)] -> [(sum log p(continuation | context), is_greedy)]."""
        prepared = []  # (request index, model input, scored tokens)
        for index, (key, context_enc, continuation_enc) in enumerate(requests):
            if not continuation_enc:
                raise ValueError("empty continuation: nothing to score")
            # A context that encodes to nothing (lm-eval moves a whitespace-only context's spaces into the
            # continuation) is conditioned on EOS, like an empty one; otherwise the first token would be read off
            # whatever sits at the row's last slot (a pad, in a batch).
            context_enc, continuation_enc = list(context_enc) or [self.prefix_token_id], list(continuation_enc)
            if scored_request(key):
                self.requests_scored += 1
                self.contexts_cut += (len(context_enc) + min(len(continuation_enc), self.max_length)
                                      > self.max_length + 1)
            # A continuation longer than the model's context is scored in consecutive pieces of max_length tokens,
            # each conditioned on as much preceding text as fits (lm-eval's HFLM refuses such requests).
            for piece in range(0, len(continuation_enc), self.max_length):
                scored = continuation_enc[piece: piece + self.max_length]
                whole = (context_enc + continuation_enc[: piece + len(scored)])[-(self.max_length + 1):]
                prepared.append((index, whole[:-1], scored))
        # Requests whose model input is identical (multiple choice with one-token answers: MMLU, BoolQ) share one
        # forward; same tokens and length also means the same SA permutation, so this is exact.
        inputs: dict[tuple, list[tuple[int, list[int]]]] = {}
        for index, inp, cont in prepared:
            inputs.setdefault(tuple(inp), []).append((index, cont))
        # Longest first: the first batch shows at once whether memory suffices, and rows of a batch have similar
        # lengths (little padding).
        unique = sorted(inputs, key=lambda inp: -len(inp))
        logprobs, greedy = [0.0] * len(requests), [True] * len(requests)
        for start in tqdm(range(0, len(unique), self.batch_size), desc="sa-lm batches", disable=disable_tqdm,
                          mininterval=10):
            chunk = unique[start: start + self.batch_size]
            with torch.no_grad(), self._precision():
                hidden = self.model.hidden_states(*self._batch(chunk))
                # the head and log-softmax only where a scored token is predicted: hidden state at position
                # end - len(cont) + t predicts cont[t]
                rows, positions, targets, owners = [], [], [], []
                for row, inp in enumerate(chunk):
                    end = len(inp)
                    for index, cont in inputs[inp]:
                        rows += [row] * len(cont)
                        positions += range(end - len(cont), end)
                        targets += cont
                        owners.append((index, len(cont)))
                device = hidden.device
                picked = hidden[torch.tensor(rows, device=device), torch.tensor(positions, device=device)]
                scores = F.log_softmax(self.model.lm_head(picked).float(), dim=-1)
                target = torch.tensor(targets, device=device)
                token_logp = scores.gather(-1, target[:, None]).squeeze(-1).tolist()
                token_greedy = (scores.argmax(-1) == target).tolist()
            offset = 0
            for index, count in owners:
                logprobs[index] += sum(token_logp[offset: offset + count])
                greedy[index] = greedy[index] and all(token_greedy[offset: offset + count])
                offset += count
        results = list(zip(logprobs, greedy))
        for (key, *_), result in zip(requests, results):
            if key and key[0] is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for index, req in enumerate(requests):
            (text,) = req.args
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((None,), context, continuation))
                owner.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, scores):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = []
        for index, req in enumerate(requests):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [stop for stop in ([until] if isinstance(until, str) else until) if stop]  # "" is in any text
            # lm-eval's aliases, in its priority order (HFLM reads them all; a task YAML may use max_new_tokens)
            lengths = [gen_kwargs.pop(key, None) for key in MAX_TOKEN_KEYS]
            max_gen = int(next((n for n in lengths if n is not None), self.max_gen_toks))
            if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature", 0.0) or 0.0) > 0:
                log.warning("sa-lm decodes greedily; ignoring sampling arguments %s", gen_kwargs)
            context_enc = self.tok_encode(context) if context else [self.prefix_token_id]
            jobs.append((index, context_enc, until, max_gen))
        jobs.sort(key=lambda job: (-len(job[1]), job[0]))
        outputs: list[str | None] = [None] * len(requests)
        for start in range(0, len(jobs), self.batch_size):
            chunk = jobs[start: start + self.batch_size]
            generated: list[list[int]] = [[] for _ in chunk]
            texts = [""] * len(chunk)
            active = [max_gen > 0 for *_, max_gen in chunk]
            while any(active):
                rows = [i for i, a in enumerate(active) if a]
                # A sequence longer than the context keeps its last max_length tokens (sliding window).
                inputs = [(chunk[i][1] + generated[i])[-self.max_length:] for i in rows]
                next_tokens = self._last_logits(inputs).argmax(-1).tolist()
                for i, token in zip(rows, next_tokens):
                    _, _, until, max_gen = chunk[i]
                    if token == self._eot:
                        active[i] = False
                        continue
                    generated[i].append(token)
                    texts[i] = self.tok_decode(generated[i])
                    if any(stop in texts[i] for stop in until) or len(generated[i]) >= max_gen:
                        active[i] = False
            for i, (index, _, until, _) in enumerate(chunk):
                text = texts[i]
                for stop in until:
                    text = text.split(stop)[0]
                outputs[index] = text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return outputs  # type: ignore[return-value]
