"""Every preset composes; every bad value is refused before work, naming the key."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, TINY, compose_train
from model.config import AttentionConfig, ConfigError, ModelConfig, from_mapping
from model.decoder import Decoder
from train import check_config, train

ATTENTIONS = sorted(p.stem for p in (ROOT / "conf" / "attention").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_every_attention_composes(attention, tmp_path, corpus_file):
    cfg = compose_train([f"attention={attention}"], tmp_path, corpus_file)
    model_cfg, attn_cfg = check_config(cfg)
    assert attn_cfg.kind == attention


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment, tmp_path):
    cfg = compose_train([f"experiment={experiment}"], tmp_path)
    assert cfg.trainer.max_steps >= 1
    from_mapping(ModelConfig, cfg.model, "model")
    from_mapping(AttentionConfig, cfg.attention, "attention")


def test_paper_preset_is_the_papers_model(tmp_path):
    cfg = compose_train(["experiment=paper_360m", "attention=gated_sa_swa"], tmp_path)
    model_cfg = from_mapping(ModelConfig, cfg.model, "model")
    assert (model_cfg.n_layers, model_cfg.d_model, model_cfg.n_heads, model_cfg.max_seq_len,
            model_cfg.vocab_size) == (24, 1024, 16, 2048, 32000)
    assert cfg.attention.window == 256 and cfg.optim.lr == 3e-4 and cfg.optim.tokens_per_step == 524288
    assert cfg.trainer.max_steps == 15_000_000_000 // 524288
    # the prepared tokens hold the whole budget outside validation: one pass, no wrap at the end
    assert cfg.data.max_tokens * (1 - 1.5 * cfg.data.val_fraction) > 15e9 > cfg.data.max_tokens * (1 - 3e-3)
    from tools.train_config import accumulation_steps

    assert [accumulation_steps(cfg, world) for world in (1, 8)] == [16, 2]
    cfg.data.batch_size = 8  # README's 4 nodes x 8 GPUs
    assert accumulation_steps(cfg, 32) == 1
    import torch

    with torch.device("meta"):
        n = Decoder(model_cfg, from_mapping(AttentionConfig, cfg.attention, "attention")).num_parameters()
    assert 340e6 <= n <= 380e6


@pytest.mark.parametrize(
    "override,key",
    [
        ("attention.kind=linear", "attention.kind"),
        ("attention.backend=cuda", "attention.backend"),
        ("attention.window=0", "attention.window"),
        ("model.n_kv_heads=3", "model.n_kv_heads"),
        ("+model.n_experts=8", "model.n_experts"),
        ("data.seq_len=0", "data.seq_len"),
        ("data.seq_len=-5", "data.seq_len"),
        ("data.window_start=middle", "data.window_start"),
        ("data.sampling=epoch", "data.sampling"),
        ("data.loss_only_after=5", "data.loss_only_after"),
        ("model.max_seq_len=0", "model.max_seq_len"),
        ("data.source.paths=[/nonexistent/corpus.jsonl]", "data.source.paths"),
        ("data.tokenizer.path=/nonexistent/tokenizer.json", "data.tokenizer.path"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("resume=yes", "resume"),
        ("data.val_windows=0", "data.val_windows"),
        ("data.val_batch_size=0", "data.val_batch_size"),
        ("trainer.precision=half", "trainer.precision"),
        ("trainer.accelerator=tpu", "trainer.accelerator"),
        ("trainer.devices=[0,-1]", "trainer.devices"),
        ("trainer.devices=two", "trainer.devices"),
        ("trainer.compile=yes", "trainer.compile"),
        ("trainer.compile=true attention.backend=flex", "trainer.compile"),
        ("optim.lr=0", "optim.lr"),
        ("optim.betas=[0.9]", "optim.betas"),
        ("optim.warmup_steps=-1", "optim.warmup_steps"),
        ("optim.warmup_steps=2.5", "optim.warmup_steps"),  # a fractional warmup overshot the peak rate
        ("optim.lr=inf", "optim.lr"),
        ("optim.lr=nan", "optim.lr"),
        ("optim.weight_decay=nan", "optim.weight_decay"),
        ("optim.eps=0", "optim.eps"),
        ("optim.grad_clip=nan", "optim.grad_clip"),
        ("data.batch_size=2.5", "data.batch_size"),  # cut to 2 in silence before
        ("trainer.max_steps=10.5", "trainer.max_steps"),
        ("trainer.max_steps=true", "trainer.max_steps"),
        ("data.num_workers=-1", "data.num_workers"),
        ("model.init_std=inf", "model.init_std"),
        ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
        ("optim.schedule_steps=-5", "optim.schedule_steps"),
        ("optim.schedule=step", "optim.schedule"),
        ("trainer.keep_checkpoints=0", "trainer.keep_checkpoints"),
        ("init_from=/nonexistent/run", "init_from"),
        ("data.max_tokens=-5", "data.max_tokens"),
        ("data.tokenizer.vocab_size=100", "data.tokenizer.vocab_size"),
        ("trainer.activation_checkpointing=1", "trainer.activation_checkpointing"),
        ("trainer.loss_chunk_tokens=-1", "trainer.loss_chunk_tokens"),
        ("trainer.loss_chunk_tokens=true", "trainer.loss_chunk_tokens"),
        ("trainer.keep_weights=maybe", "trainer.keep_weights"),
        ("optim.decay_fraction=0", "optim.decay_fraction"),
        ("optim.decay_fraction=1.5", "optim.decay_fraction"),
        ("model.ffn_hidden=0", "model.ffn_hidden"),
        ("model.norm_eps=-1", "model.norm_eps"),
        ("model.n_kv_heads=2.0", "model.n_kv_heads"),
        ("model.vocab_size=true", "model.vocab_size"),
        ("model.rope_theta=1e", "model.rope_theta"),
        ("model.rope_theta=1", "model.rope_theta"),  # every frequency 1 rad/token: positions repeat every ~6 tokens
        ("attention.kind=moba attention.window=1", "attention.window"),  # blocks of 1, top-2: 2 keys for w=1
        ("attention.window=true", "attention.window"),
        ("attention.eval_seed=first", "attention.eval_seed"),
        ("attention.per_sequence_perm=1", "attention.per_sequence_perm"),
        ("eval.after_train=true eval.tasks=[wikitext,hellaswg]", "eval.tasks"),  # before training, not after
        # each crashed inside preparation or training, or was cut in silence (32.5 -> 32)
        ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps"),
        ("trainer.log_every_n_steps=-1", "trainer.log_every_n_steps"),
        ("trainer.log_every_n_steps=abc", "trainer.log_every_n_steps"),
        ("data.shard_tokens=null", "data.shard_tokens"),
        ("data.tokenizer.train_chars=null", "data.tokenizer.train_chars"),
        ("data.tokenizer.train_chars=-5", "data.tokenizer.train_chars"),
        ("data.seq_len=null", "data.seq_len"),
        ("data.seq_len=65", "data.seq_len"),  # past tiny's model.max_seq_len=64
        ("data.seq_len=32.5", "data.seq_len"),
        ("data.val_fraction=abc", "data.val_fraction"),
        ("data.val_fraction=1", "data.val_fraction"),  # no training document left
        ("seed=-1", "seed"),
        # added with + (Hydra's advice for a misspelled key): read by nothing, the run would train without it
        ("+trainer.gradient_clip_val=1.0", "trainer.gradient_clip_val"),
        ("+optim.warmup=10", "optim.warmup"),
        ("+data.source.text_feild=body", "data.source.text_feild"),
        ("+eval.fewshot=5", "eval.fewshot"),  # zero-shot scores under a five-shot name
        ("eval.after_train=true eval.num_fewshot=-1", "eval.num_fewshot"),
        ("eval.after_train=true eval.data_dir=/no/such/evaldata", "eval.data_dir"),  # all skipped after training
        ("eval.after_train=true eval.batch_size=0", "eval.batch_size"),
        ("eval.after_train=true eval.dtype=fp8", "eval.dtype"),
        ("trainer.strategy=ddp_spawn", "trainer.strategy"),  # its workers return no step: the last save was skipped
        ("seed=abc", "seed"),
        ("data.tokenizer.vocab_size=600", "model.vocab_size"),  # tiny's 512: refused after tokenizing the corpus
        *([("trainer.devices=[0]", "trainer.devices")] if not torch.cuda.is_available() else []),
        *([("attention.backend=flex", "attention.backend"), ("trainer.precision=16-mixed", "trainer.precision"),
           ("trainer.precision=16-true", "trainer.precision"),  # fp16 weights: a NaN loss by step 4 (AdamW's eps)
           ("trainer=fsdp trainer.accelerator=cpu trainer.devices=2", "trainer.strategy")]
          if not torch.cuda.is_available() else []),  # no FlexAttention backward, no fp16 autocast on the CPU
        *([("trainer=ddp", "trainer.accelerator")] if not torch.cuda.is_available() else []),  # a GPU preset on CPU
    ],
)
def test_bad_config_is_refused_with_its_key(override, key, tmp_path, corpus_file):
    cfg = compose_train(TINY + override.split(), tmp_path, corpus_file)  # a space separates two overrides
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert err.value.key == key and key in str(err.value)



def test_an_odd_head_dim_is_refused_for_rope():
    """RoPE turns component i with i + D/2 (model/layers.py): an odd head dim leaves one without a partner and the
    first forward pass failed on a shape mismatch inside RoPE. The config refuses it, naming model.d_model."""
    assert ModelConfig(d_model=56, n_heads=4).head_dim == 14
    for d_model, n_heads in ((60, 4), (36, 12)):  # head dims 15 and 3
        with pytest.raises(ConfigError, match="even for RoPE") as err:
            ModelConfig(d_model=d_model, n_heads=n_heads)
        assert err.value.key == "model.d_model"

def test_shots_a_local_test_only_task_cannot_give_are_refused_before_training(tmp_path, corpus_file):
    """eval.num_fewshot=2 with local wikitext and LAMBADA (test splits only) failed after the whole run."""
    from test_evaluation import make_truth, wiki_articles, write_evaldata

    evaldata = write_evaldata(tmp_path / "evaldata", make_truth(), wiki_articles(2))
    given = TINY + ["eval.after_train=true", f"eval.data_dir={evaldata}", f"paths.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(ConfigError, match="no non-test split") as err:
        check_config(compose_train(given + ["eval.num_fewshot=2"], tmp_path, corpus_file))
    assert err.value.key == "eval.num_fewshot"
    check_config(compose_train(given + ["eval.num_fewshot=0"], tmp_path, corpus_file))


@pytest.mark.parametrize("data,key", [("files", "data.source.paths"), ("hf", "data.source.name")])
def test_a_required_value_left_unset_is_named(data, key, tmp_path):
    cfg = compose_train(TINY + [f"data={data}"], tmp_path)
    with pytest.raises(ConfigError, match=f"give it on the command line: {key}=<value>") as err:
        check_config(cfg)
    assert err.value.key == key


def test_any_hub_dataset_is_one_preset_and_slimpajama_is_that_preset_with_a_name(tmp_path):
    cfg = compose_train(TINY + ["data=hf", "data.source.name=some/dataset", "data.source.revision=abc"], tmp_path)
    assert (cfg.data.source.kind, cfg.data.source.name, cfg.data.source.revision) == ("hf", "some/dataset", "abc")
    check_config(cfg)
    slim = compose_train(["data=slimpajama"], tmp_path).data.source
    assert dict(slim) == {**dict(cfg.data.source), "name": "cerebras/SlimPajama-627B", "revision": None}


def test_triton_training_on_the_cpu_is_refused_without_the_interpreter(tmp_path, corpus_file, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the Triton backend runs on this machine's GPU")
    cfg = compose_train(TINY + ["attention.backend=triton"], tmp_path, corpus_file)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="need a CUDA GPU") as err:
        check_config(cfg)
    assert err.value.key == "attention.backend"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter (the tests' way) is allowed
    check_config(cfg)


@pytest.mark.parametrize("name", ["small", "360m"])
def test_benchmark_reads_the_same_model_presets_as_training(name, tmp_path):
    from bench.model import model_config

    cfg = compose_train([f"model={name}"], tmp_path / "run")
    assert model_config(name) == from_mapping(ModelConfig, cfg.model, "model")


def test_tokens_per_step_that_does_not_divide_is_refused_before_data_preparation(tmp_path, corpus_file):
    from train import train

    cfg = compose_train(TINY + ["optim.tokens_per_step=1000"], tmp_path / "run", corpus_file, tmp_path / "cache")
    with pytest.raises(ConfigError, match="multiple of data.batch_size") as err:
        train(cfg)
    assert err.value.key == "optim.tokens_per_step"
    assert not (tmp_path / "cache").exists()  # nothing was tokenized
    # an accumulation it would override in silence (TINY: batch 4 x the tiny model's seq_len)
    per_micro = 4 * int(cfg.data.seq_len)
    cfg = compose_train(TINY + [f"optim.tokens_per_step={2 * per_micro}", "trainer.accumulate_grad_batches=3"],
                        tmp_path / "run", corpus_file, tmp_path / "cache")
    with pytest.raises(ConfigError, match="give one of the two") as err:
        train(cfg)
    assert err.value.key == "trainer.accumulate_grad_batches" and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("override", ["trainer.max_steps=1e3", "trainer.max_steps=${oc.env:SA_TEST_STEPS,100}",
                                      "optim.warmup_steps=2.0", "trainer.precision=32", "data.max_tokens=1e9",
                                      "data.shard_tokens=1e8", "trainer.loss_chunk_tokens=8e3",
                                      "trainer.keep_checkpoints=2.0", "optim.schedule_steps=1e2",
                                      "data.seq_len=${oc.env:SA_TEST_SEQ,64}", "seed=1e3",
                                      "data.tokenizer.train_chars=2e7"])
def test_whole_numbers_in_other_spellings_are_accepted(override, tmp_path, corpus_file):
    """1e3 comes from Hydra as 1000.0, an ${oc.env:...} as a string: both are whole numbers, and each key reads
    them as one from then on (the data cache's key too)."""
    from tools.train_config import WHOLE_NUMBER_KEYS

    cfg = compose_train(TINY + override.split(), tmp_path, corpus_file)
    check_config(cfg)
    key = override.split("=")[0]
    if key not in ("trainer.precision", "data.tokenizer.train_chars"):  # train_chars: cached under its spelling
        assert key in WHOLE_NUMBER_KEYS and type(OmegaConf.select(cfg, key)) is int


def test_warmup_as_long_as_the_schedule_is_warned_about(tmp_path, corpus_file, capsys):
    check_config(compose_train(TINY + ["optim.warmup_steps=5", "trainer.max_steps=5"], tmp_path, corpus_file))
    assert "never leaves warmup" in capsys.readouterr().err
    check_config(compose_train(TINY + ["optim.warmup_steps=4", "trainer.max_steps=5"], tmp_path, corpus_file))
    assert "never leaves warmup" not in capsys.readouterr().err


def test_window_at_least_context_is_valid(tmp_path, corpus_file):
    cfg = compose_train(TINY + ["attention=swa", "attention.window=4096"], tmp_path, corpus_file)
    check_config(cfg)


def test_vocabulary_smaller_than_tokenizer_is_refused(tmp_path, corpus_file, data_cache):
    cfg = compose_train(TINY + ["model.vocab_size=300", "trainer.max_steps=1"], tmp_path / "a", corpus_file, data_cache)
    from data.prepare import prepare

    prepared = prepare(cfg.data, data_cache, progress=False)
    cfg = compose_train(TINY + ["model.vocab_size=200", f"data.tokenizer.path={prepared.tokenizer_path}"],
                        tmp_path / "b", corpus_file, data_cache)
    with pytest.raises(ConfigError, match="model.vocab_size"):
        train(cfg)
    assert not Path(tmp_path / "b" / "checkpoints").exists()


def test_pure_fp16_with_an_eps_that_underflows_is_warned_about(tmp_path, corpus_file, capsys):
    """16-true keeps AdamW's state in fp16, where eps=1e-8 is 0: the audit's CPU run went NaN at step 4. On a GPU it
    is allowed (prepare_only skips the CPU's own refusal here), with a warning; a larger eps is not warned about."""
    cfg = compose_train(TINY + ["trainer.precision=16-true", "prepare_only=true"], tmp_path, corpus_file)
    check_config(cfg)
    assert "trainer.precision=16-true keeps weights and AdamW's state in fp16" in capsys.readouterr().err
    check_config(compose_train(TINY + ["trainer.precision=16-true", "prepare_only=true", "optim.eps=1e-4"],
                               tmp_path, corpus_file))
    assert "16-true" not in capsys.readouterr().err


def test_a_tokenizer_without_an_end_of_text_token_is_refused_before_the_corpus_is_read(tmp_path):
    """Documents are separated by an end-of-text token; a tokenizer.json without one failed after the model was
    built, with a ValueError that named no key."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from tools.train_config import _check_vocabulary

    path = tmp_path / "tokenizer.json"
    Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(ConfigError, match=r"data.tokenizer.path=.*none of <\|endoftext\|>, </s>") as err:
        _check_vocabulary(OmegaConf.create({"path": str(path)}), 512)
    assert err.value.key == "data.tokenizer.path"
    Tokenizer(WordLevel({"a": 0, "[UNK]": 1, "</s>": 2}, unk_token="[UNK]")).save(str(path))
    _check_vocabulary(OmegaConf.create({"path": str(path)}), 512)  # a foreign end-of-text token is taken


def _readme_train_commands() -> list[list[str]]:
    """The overrides of every `python train.py ...` line in README.md's code blocks (continuations joined,
    placeholders such as <config> filled in, a sweep's first value)."""
    import re
    import shlex

    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0] if "python train.py" in line.split("#")[0] else ""
            if not line:
                continue
            words = shlex.split(re.sub(r"<[^>]*>", "x", line.split("python train.py", 1)[1]))
            commands.append([w.split(",")[0] if "=" in w and not w.startswith("data.source.paths") else w
                             for w in words if w != "-m"])
    return commands


def test_every_train_command_in_the_readme_composes(tmp_path):
    commands = _readme_train_commands()
    assert len(commands) >= 5 and ["data=hf", "data.source.name=x", "data.source.config=x",
                                   "data.max_tokens=1000000000"] in commands
    for overrides in commands:
        compose_train(overrides, tmp_path / "run")  # a key the configs do not have fails here


def test_a_refused_launch_leaves_no_run_folder_and_keeps_one_with_a_record(tmp_path):
    import shutil
    import subprocess
    import sys

    def launch(*args, cwd=tmp_path):
        return subprocess.run([sys.executable, str(ROOT / "train.py"), "model=tiny", "+optim.warmup=3", *args],
                              cwd=cwd, capture_output=True, text=True, timeout=120)

    new, kept = tmp_path / "new", tmp_path / "kept"
    proc = launch(f"hydra.run.dir={new}")
    assert proc.returncode == 2 and "optim.warmup" in proc.stderr and not new.exists()
    (kept / ".hydra").mkdir(parents=True)
    (kept / "train.log").write_text("data: prepared by an earlier prepare_only=true launch\n")
    assert launch(f"hydra.run.dir={kept}").returncode == 2
    assert "prepared by an earlier" in (kept / "train.log").read_text()
    # the launch directory (hydra.run.dir=.), empty before: what the launch wrote goes, the folder stays
    here = tmp_path / "here"
    here.mkdir()
    assert launch("hydra.run.dir=.", cwd=here).returncode == 2
    assert here.is_dir() and not list(here.iterdir())
    # the default run folder (runs/train/<date>_<kind>) of a first launch here: no empty runs/train/ is left either
    # (runs/, paths.log_dir, stays: it may be the user's), while a folder that holds another run keeps it
    assert launch(cwd=here).returncode == 2
    assert [p.name for p in here.iterdir()] == ["runs"] and not list((here / "runs").iterdir())
    (here / "runs" / "train" / "earlier").mkdir(parents=True)
    assert launch(cwd=here).returncode == 2
    assert [p.name for p in (here / "runs" / "train").iterdir()] == ["earlier"]
    # a run folder outside the launch directory goes, and its parent, there before, stays; so does an empty folder
    # of the user's that holds the run folder (it is not under runs/)
    assert launch(f"hydra.run.dir={tmp_path / 'elsewhere' / 'run'}", cwd=here).returncode == 2
    assert (tmp_path / "elsewhere").is_dir() and not list((tmp_path / "elsewhere").iterdir())
    (here / "mine").mkdir()
    assert launch("hydra.run.dir=mine/run", cwd=here).returncode == 2
    assert (here / "mine").is_dir() and not list((here / "mine").iterdir())
    # links to other storage: a linked runs/ and a linked run folder stay, and so do their targets
    store, scratch = tmp_path / "store", tmp_path / "scratch"
    (store / "runs").mkdir(parents=True)
    (scratch / "run1").mkdir(parents=True)
    logs = tmp_path / "logs"  # a log folder made beforehand, empty
    logs.mkdir()
    assert launch(f"paths.log_dir={logs}", cwd=here).returncode == 2
    assert logs.is_dir() and not list(logs.iterdir())
    shutil.rmtree(here / "runs")
    (here / "runs").symlink_to(store / "runs")
    assert launch(cwd=here).returncode == 2
    assert (here / "runs").is_symlink() and (store / "runs").is_dir() and not list((store / "runs").iterdir())
    (store / "runs" / "train").mkdir()
    (store / "runs" / "train" / "run1").symlink_to(scratch / "run1")
    for _ in range(2):  # the second finds the link as the first left it
        assert launch("hydra.run.dir=runs/train/run1", cwd=here).returncode == 2
        assert (scratch / "run1").is_dir() and not list((scratch / "run1").iterdir())
    # evaluate.py of a missing checkpoint: its runs/eval/<suite>-<time>, and the runs/eval/ and runs/ that leaves
    evaluated = tmp_path / "evaluated"
    evaluated.mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "ckpt=missing"], cwd=evaluated,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no checkpoint" in proc.stderr
    assert [p.name for p in evaluated.iterdir()] == ["runs"] and not list((evaluated / "runs").iterdir())


def test_a_misspelled_key_on_the_command_line_gets_a_did_you_mean():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "train.py", "attention=sa", "attention.windwo=64"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "not in struct" in proc.stderr  # Hydra's own refusal, before any work
    assert "hint: 'attention.windwo' is not a key of this config; did you mean 'attention.window'?" in proc.stderr
    assert "would add the misspelled key as a new one" in proc.stderr  # against Hydra's "+attention.windwo=64"


def test_an_added_key_nothing_reads_is_refused_with_the_key_it_meant(tmp_path, corpus_file):
    for added, meant in (("+trainer.gradient_clip_val=1", "optim.grad_clip"),
                         ("+optim.warmup=3", "optim.warmup_steps"),
                         ("+data.tokenizer.vocab=300", "data.tokenizer.vocab_size")):
        with pytest.raises(ConfigError, match=f"did you mean {meant}\\?"):
            check_config(compose_train(TINY + [added], tmp_path, corpus_file))
    with pytest.raises(ConfigError, match="the keys of optim: lr, weight_decay"):
        check_config(compose_train(TINY + ["+optim.zzz=1"], tmp_path, corpus_file))


@pytest.mark.parametrize("section", ["trainer", "optim", "data", "eval"])
def test_the_read_keys_cover_every_preset(section):
    """Every key a preset sets in trainer, optim, data or eval is one that is read (else check_config refuses it)."""
    from tools.config_hints import READ_KEYS, unread_key

    assert unread_key("optim.warmup") and unread_key("data.source.foo.bar") and unread_key("eval.fewshot")
    assert not unread_key("optim.lr") and not unread_key("model.foo") and not unread_key("data.probes.task")

    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        raw = OmegaConf.load(path)
        # a group's own file is the section; a global-package file (experiment=, data=probes) holds it by name
        node = raw if path.parent.name == section and section not in raw else raw.get(section)
        for sub in ([] if node is None else [section] + [f"{section}.{k}" for k in node if f"{section}.{k}" in
                                                          READ_KEYS]):
            keys = node if sub == section else node[sub.partition(".")[2]]
            assert set(keys) - {"defaults"} <= set(READ_KEYS[sub]), (path, sub)


def test_key_hints_for_each_entry_point():
    from tools.config_hints import unknown_key_hints

    assert unknown_key_hints("train", ["attention=sa", "attention.window=64", "seed=3"]) == []  # all known
    assert unknown_key_hints("train", ["-m", "attention=full,sa", "trainer.lr=1"]) == [
        "hint: 'trainer.lr' is not a key of this config; did you mean 'optim.lr'?"]
    # a preset's own keys are known once its group choice is composed
    assert unknown_key_hints("train", ["experiment=paper_360m", "train_tokens=1000"]) == []
    assert unknown_key_hints("train", ["train_tokens=1000"]) == [
        "hint: 'train_tokens' is not a key of this config; the keys at the top: "
        + ", ".join(sorted(compose_keys("train")))]
    assert "did you mean 'eval.num_seeds'?" in unknown_key_hints("evaluate", ["eval.num_seed=2"])[0]
    assert "did you mean 'top_k' or 'top_p'?" in unknown_key_hints("sample", ["top_kk=3"])[0]
    assert unknown_key_hints("train", ["+model.n_experts=8", "hydra.run.dir=x", "hydra/launcher=basic",
                                       "~seedd", "+seedd=1", "data=files", "data.source.paths.0=a"]) == []  # not typos
    for sweep in ("attention=choice(full,sa)", "attention=glob(*)"):
        assert unknown_key_hints("train", [sweep, "attention.windwo=3"]) == [
            "hint: 'attention.windwo' is not a key of this config; did you mean 'attention.window'?"]


def test_key_hints_keep_the_exit_and_never_hide_the_error(monkeypatch, capsys):
    import sys

    import tools.config_hints as hints

    def stop(code):
        def main():
            raise SystemExit(code)
        return main

    monkeypatch.setattr(sys, "argv", ["train.py", "trainer.max_step=3"])
    for code in (0, 2, 143):  # a finished run, a ConfigError, a SIGTERM stop: Hydra took the keys, no hint
        with pytest.raises(SystemExit) as exit_:
            hints.run_with_key_hints(stop(code), "train")
        assert exit_.value.code == code and "hint:" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        hints.run_with_key_hints(stop(1), "train")
    assert exit_.value.code == 1 and "did you mean 'trainer.max_steps'?" in capsys.readouterr().err
    monkeypatch.setattr(hints, "unknown_key_hints", lambda *a: 1 / 0)  # the hint itself failing
    with pytest.raises(SystemExit) as exit_:
        hints.run_with_key_hints(stop(1), "train")
    assert exit_.value.code == 1
    with pytest.raises(KeyError):  # HYDRA_FULL_ERROR=1: Hydra's own exception goes on
        hints.run_with_key_hints(lambda: {}["x"], "train")


def compose_keys(config_name: str) -> list[str]:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return list(compose(config_name=config_name))


def test_the_log_line_names_the_window_and_backend_only_where_they_apply():
    assert AttentionConfig(kind="full", window=64).describe() == "attention=full (causal SDPA)"
    assert AttentionConfig(kind="full", backend="naive").describe() == \
        "attention=full (the dense reference, backend=naive)"
    assert AttentionConfig(kind="moba", window=32).describe() == "attention=moba window=32"  # its own PyTorch code
    assert AttentionConfig(kind="sa", window=32, backend="torch").describe() == "attention=sa window=32 backend=torch"


def test_a_key_added_at_the_top_that_nothing_reads_is_refused(tmp_path, corpus_file):
    """Hydra answers `max_steps=100` with "use +max_steps=100", which adds a top-level key nothing reads: the run
    went on for the default number of steps. Refused, with the key it meant; a key the chosen preset sets, and an
    added key an interpolation reads (in any spelling, or in a Hydra setting) are kept."""
    import subprocess
    import sys

    from tools.config_hints import declared_top_keys, refuse_unread_top_keys

    def check(overrides, hydra=()):
        refuse_unread_top_keys(compose_train(TINY + overrides, tmp_path, corpus_file), "train", TINY + overrides,
                               list(hydra))

    for added, meant in (("+max_steps=100", "did you mean trainer.max_steps\\?"), ("+lr=1e-3", "optim.lr"),
                         ("++seeds=3", "did you mean seed\\?"), ("+zzz=1", "the keys at the top: attention, "),
                         ("+train_tokens=4000000", "the keys at the top"),  # the key of a preset not chosen
                         ):
        with pytest.raises(ConfigError, match=f"{added.lstrip('+').partition('=')[0]}=.*nothing reads.*{meant}"):
            check([added])
    for reads in ("'${steps:${tokens},1024}'", "'${steps:${oc.select: tokens,4096},1024}'",
                  "'${steps:${oc.select:\"tokens\",4096},1024}'"):
        check(["+tokens=4096", f"trainer.max_steps={reads}"])
    check(["+tokens=4096", "data.max_tokens='${..tokens}'"])
    with pytest.raises(ConfigError, match="tag='foo'"):
        check(["+tag=foo"], ["hydra.run.dir=runs/x"])
    check(["+tag=foo"], ["hydra.run.dir=runs/${tag}"])
    check(["experiment=paper_360m", "trainer.max_steps=3"])  # train_tokens, no longer read, is the preset's own
    check(["experiment=paper_360m", "++train_tokens=4000000"])
    assert "train_tokens" not in declared_top_keys("train") and "ckpt" in declared_top_keys("evaluate")
    assert {"train_tokens", "task_name"} <= declared_top_keys("train", ["experiment=paper_360m"])
    # the entry points: each refuses before any work, exit 2, and takes a key its command line interpolates
    for script, args in (("evaluate.py", ["ckpt=x", "+num_seeds=3"]), ("sample.py", ["ckpt=x", "+temp=0"]),
                         ("train.py", ["model=tiny", "+max_steps=3"])):
        proc = subprocess.run([sys.executable, str(ROOT / script), *args, f"hydra.run.dir={tmp_path / 'out'}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "nothing reads" in proc.stderr, (script, proc.stderr[-2000:])
    proc = subprocess.run([sys.executable, str(ROOT / "sample.py"), "ckpt=x", "+tag=a",
                           f"hydra.run.dir={tmp_path / 'out'}" + "/${tag}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "no checkpoint" in proc.stderr and "nothing reads" not in proc.stderr
