"""Sweep presets compose, the multirun + DDP guard fails fast, and tools.compare reads real run directories."""

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import ROOT, TINY, compose_train

PRESETS = {
    "ablation": {"attention": "full,swa,sa,gated_sa_swa", "seed": "0,1,2"},
    "window_sweep": {"attention": "swa,sa,gated_sa_swa", "attention.window": "8,16,32,64", "seed": "0,1"},
    "probes_cpu": {"attention": "full,swa,sa,gated_sa_swa"},
    "paper_small_cpu": {"attention": "full,swa,sa,gated_sa_swa", "seed": "0,1"},
}


def compose_with_hydra(overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="train", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_sweep_presets_compose(preset, tmp_path):
    from train import check_config  # noqa: F401  (registers the `steps` resolver the presets use)

    extra = ["data.source.paths=[/corpus/*.jsonl.gz]"] if preset == "paper_small_cpu" else []
    cfg = compose_train([f"experiment={preset}", "attention=sa"] + extra, tmp_path)
    assert cfg.task_name == preset and cfg.attention.kind == "sa"
    OmegaConf.to_container(cfg.model, resolve=True)
    OmegaConf.to_container(cfg.trainer, resolve=True)
    full = compose_with_hydra([f"experiment={preset}"] + extra)
    assert dict(full.hydra.sweeper.params) == PRESETS[preset]
    assert full.hydra.callbacks.multirun_guard._target_ == "tools.guards.MultirunDDPGuard"
    wandb = OmegaConf.to_container(full.logger.wandb, resolve=False)
    assert wandb["group"] == "${task_name}_${now:%Y-%m-%d_%H-%M-%S}"  # one W&B group per sweep (= its folder)
    assert full.task_name == preset
    assert "${attention.kind}" in wandb["tags"] and "${sa_window_tag:${attention.kind},${attention.window}}" in \
        wandb["tags"]
    sweep = OmegaConf.to_container(full.hydra.sweep, resolve=False)
    assert sweep["subdir"] == "${hydra.job.num}_${sa_attention_tag:${attention.kind},${attention.window}}_s${seed}"


@pytest.mark.parametrize("attention, subdir, run_name, tags", [
    ("full", "3_full_s0", "full-s0", ["full", "s0", "t"]), ("sa", "3_sa_w32_s0", "sa-w32-s0", ["sa", "w32", "s0", "t"]),
    ("gated_sa_swa", "3_gated_sa_swa_w32_s0", "gated_sa_swa-w32-s0", ["gated_sa_swa", "w32", "s0", "t"])])
def test_sweep_folders_and_run_names_carry_a_window_only_where_one_applies(attention, subdir, run_name, tags,
                                                                           tmp_path, monkeypatch):
    """Full attention ignores the window, yet its sweep folder was 0_full_w256_s0, its run full-w256-s0, and its
    W&B tags held w256."""
    from omegaconf import open_dict

    import train

    cfg = compose_with_hydra([f"attention={attention}", "logger=wandb_sweep", "task_name=t"])
    with open_dict(cfg):
        cfg.hydra.job.num = 3
    assert OmegaConf.to_container(cfg.hydra.sweep, resolve=True)["subdir"] == subdir
    assert cfg.run_name == run_name
    monkeypatch.setenv("WANDB_MODE", "offline")  # _loggers sets it for the process: restored after the test
    run = compose_train([f"attention={attention}", "logger=wandb_sweep", "logger.wandb.mode=offline", "task_name=t",
                         "attention.window=32"], tmp_path)
    wandb = [log for log in train._loggers(run, tmp_path, None) if type(log).__name__ == "WandbLogger"]
    assert wandb[0]._wandb_init["tags"] == tags


def test_presets_sizes(tmp_path):
    from train import check_config

    probes = compose_train(["experiment=probes_cpu", "attention=swa"], tmp_path)
    reach = probes.model.n_layers * (probes.attention.window - 1)
    assert reach == 124 and probes.data.seq_len == 1024
    paper = compose_train(["experiment=paper_small_cpu", "data.source.paths=[x]"], tmp_path)
    assert OmegaConf.select(paper, "trainer.max_steps") == 2_000_000 // 4096
    with pytest.raises(Exception, match="data.source.paths"):  # the corpus must be given on the command line
        check_config(compose_train(["experiment=paper_small_cpu"], tmp_path))


def test_multirun_ddp_guard():
    from model.config import ConfigError
    from tools.guards import multirun_ddp_problem, refuse_multirun_ddp

    ddp = OmegaConf.create({"trainer": {"strategy": "ddp", "devices": 2, "num_nodes": 1, "accelerator": "cpu"}})
    assert "re-run the whole sweep" in multirun_ddp_problem(ddp, multirun=True)
    assert multirun_ddp_problem(ddp, multirun=False) is None  # a single DDP run is fine
    for ok in ({"strategy": "auto", "devices": 1}, {"strategy": "ddp", "devices": 1, "num_nodes": 1},
               {"strategy": "ddp_spawn", "devices": 2}):
        assert multirun_ddp_problem(OmegaConf.create({"trainer": ok}), multirun=True) is None, ok
    with pytest.raises(ConfigError, match="trainer.strategy='ddp'.*trainer.devices=1"):
        refuse_multirun_ddp(ddp, multirun=True)
    refuse_multirun_ddp(ddp)  # no Hydra job here: not a multirun


def test_multirun_with_ddp_fails_fast_from_the_command_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", "experiment=ablation", "trainer=ddp_cpu",
                          "logger=csv", f"paths.log_dir={tmp_path}/runs", f"paths.cache_dir={tmp_path}/cache"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "Hydra multirun (-m) cannot use trainer.strategy=ddp" in res.stderr + res.stdout
    assert not list(tmp_path.glob("runs/**/metrics.csv"))  # nothing trained


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, corpus_file, data_cache):
    from train import train

    root = tmp_path_factory.mktemp("sweep")
    for i, kind in enumerate(("swa", "sa")):
        run = root / f"{i}_{kind}_w8_s0"
        train(compose_train(TINY + [f"attention={kind}", "attention.window=8", "trainer.max_steps=6",
                                    "trainer.val_every_n_steps=3", "trainer.checkpoint_every_n_steps=6",
                                    "data.val_windows=2"], run, corpus_file, data_cache))
    results = {"results": [{"task": "lambada_openai", "metric": "acc", "value": 0.25, "stderr": 0.01}]}
    (root / "1_sa_w8_s0" / "eval" / "suite").mkdir(parents=True)
    (root / "1_sa_w8_s0" / "eval" / "suite" / "results.json").write_text(json.dumps(results))
    return root


def test_compare_table_and_plots_from_real_runs(two_runs, tmp_path):
    from tools.compare import compare, main
    from tools.runs import find_runs, load_run

    assert [p.name for p in find_runs([two_runs])] == ["0_swa_w8_s0", "1_sa_w8_s0"]
    result = compare([str(two_runs)], tmp_path / "out")
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"swa", "sa"} and rows["sa"]["window"] == 8 and rows["sa"]["seed"] == 0
    for row in rows.values():
        assert row["steps"] == 6 and row["tokens"] == 6 * 4 * 64
        assert row["val_loss"] > 0 and row["val_ppl"] > 1 and row["train_loss"] > 0 and row["tokens_per_s"] > 0
        assert 10_000 < row["params"] < 200_000
    assert rows["sa"]["eval:lambada_openai/acc"] == 0.25 and rows["swa"]["eval:lambada_openai/acc"] is None
    text = (tmp_path / "out" / "compare.md").read_text()
    assert "| 1_sa_w8_s0 | sa | 8 | 0 | 6 | 1,536 |" in text and "lambada_openai/acc" in text
    assert "| sa w=8 | 1 |" in text
    assert (tmp_path / "out" / "val_loss_vs_tokens.png").stat().st_size > 10_000
    run = load_run(two_runs / "0_swa_w8_s0")
    steps, _ = run.series("val/loss")
    assert steps == [0, 3, 6] and run.tokens_at(steps) == [0.0, 3 * 256, 6 * 256]
    assert main([str(two_runs / "0_swa_w8_s0"), str(two_runs / "1_sa_w8_s0"), "--out", str(tmp_path / "cli"),
                 "--no-plots"]) == 0
    assert (tmp_path / "cli" / "compare.md").is_file()


def _fake_run(root, name, seed=0, kind="sa", window=8, max_steps=30, rows=(), lr=1e-3, evals=(), ckpts=("last",),
              trainer=None):
    """A run directory as train.py leaves it (config.yaml, metrics.csv, checkpoints/, eval/), without training."""
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    for c in ckpts:
        (run / "checkpoints" / f"{c}.ckpt").write_bytes(b"")
    OmegaConf.save(OmegaConf.create({
        "seed": seed, "task_name": "t", "run_name": name, "paths": {"run_dir": str(run)},
        "attention": {"kind": kind, "window": window}, "optim": {"lr": lr, "tokens_per_step": None},
        "trainer": {"max_steps": max_steps, "val_every_n_steps": 10, "log_every_n_steps": 10, "devices": 1,
                    "num_nodes": 1, "accumulate_grad_batches": 1, **(trainer or {})},
        "data": {"batch_size": 2, "seq_len": 16}}), run / "config.yaml")
    lines = ["epoch,step,train/loss,train/tokens,val/loss"] + [",".join(map(str, r)) for r in rows]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    for folder, ckpt, value in evals:
        (run / "eval" / folder).mkdir(parents=True)
        (run / "eval" / folder / "results.json").write_text(json.dumps(
            {"checkpoint": str(run / "checkpoints" / ckpt),
             "results": [{"task": "probe_needle", "metric": "acc", "value": value}]}))
    return run


def test_runs_that_differ_beyond_the_seed_are_not_pooled(tmp_path):
    from tools.compare import compare

    rows = [(0, 9, 2.0, 320, ""), (0, 9, "", "", 2.1)]
    for name, seed, steps in (("a", 0, 30), ("b", 1, 30), ("c", 0, 60)):  # c: twice the steps, not a third seed
        _fake_run(tmp_path, name, seed=seed, max_steps=steps, rows=rows)
    _fake_run(tmp_path, "d", seed=2, max_steps=30, lr=3e-3, rows=rows)
    groups = {}
    for r in compare([str(tmp_path)], tmp_path / "out", plots=False)["rows"]:
        groups.setdefault(r["group"], []).append(r["run"])
    assert groups == {"sa w=8 (optim.lr=0.001, trainer.max_steps=30)": ["a", "b"],
                      "sa w=8 (optim.lr=0.001, trainer.max_steps=60)": ["c"],
                      "sa w=8 (optim.lr=0.003, trainer.max_steps=30)": ["d"]}  # run-local keys (paths) never split


def test_seeds_that_differ_only_in_how_checkpoints_are_kept_or_shown_are_pooled(tmp_path):
    from tools.compare import compare

    rows = [(0, 9, 2.0, 320, ""), (0, 9, "", "", 2.1)]
    for name, seed, trainer in (("a", 0, {"progress_bar": True, "keep_checkpoints": None}),
                                ("b", 1, {"progress_bar": False, "keep_checkpoints": None}),
                                ("c", 2, {"progress_bar": True, "keep_checkpoints": 3, "keep_weights": False})):
        _fake_run(tmp_path, name, seed=seed, rows=rows, trainer=trainer)
    groups = {r["group"] for r in compare([str(tmp_path)], tmp_path / "out", plots=False)["rows"]}
    assert len(groups) == 1, groups


def test_evals_of_a_run_copied_without_checkpoints_are_still_the_final_ones(tmp_path):
    import shutil
    import time

    from tools.runs import read_evals

    run = _fake_run(tmp_path, "r", evals=[("probes", "last.ckpt", 0.9)])
    time.sleep(0.01)
    _fake_run(tmp_path, "later", evals=[("probes_step280", "step0000280.ckpt", 0.2)])
    shutil.move(tmp_path / "later" / "eval" / "probes_step280", run / "eval")  # newer, of an intermediate checkpoint
    shutil.rmtree(run / "checkpoints")
    assert read_evals(run) == {"probe_needle/acc": 0.9}


def test_the_answer_accuracy_a_probe_run_logs_is_a_column(tmp_path):
    from tools.compare import compare

    run = _fake_run(tmp_path, "probe", rows=[(0, 9, 2.0, 320, "")])
    with open(run / "metrics.csv", "a") as f:  # what a data.loss_only_after run logs at its validations
        f.write("0,9,,,1.5,0.75\n")
    lines = (run / "metrics.csv").read_text().splitlines()
    (run / "metrics.csv").write_text("\n".join([lines[0] + ",val/answer_acc"] + lines[1:]) + "\n")
    result = compare([str(run)], plots=False)
    assert result["rows"][0]["eval:val/answer_acc"] == 0.75 and "val/answer_acc" in result["markdown"]
    assert (run / "compare" / "compare.md").is_file()  # one run given: beside it


def test_evals_on_a_limited_number_of_examples_are_keyed_apart(tmp_path):
    """A smoke test (eval.limit=10) run after the full evaluation replaced the run's score, newest winning."""
    import time

    from tools.runs import read_evals

    run = _fake_run(tmp_path, "r", evals=[("quick", "last.ckpt", 0.4)])
    time.sleep(0.01)
    (run / "eval" / "smoke").mkdir()
    (run / "eval" / "smoke" / "results.json").write_text(json.dumps(
        {"checkpoint": str(run / "checkpoints" / "last.ckpt"), "limit": 10,
         "results": [{"task": "probe_needle", "metric": "acc", "value": 0.9}]}))
    assert read_evals(run) == {"probe_needle/acc": 0.4, "probe_needle/acc [limit=10]": 0.9}


def test_the_final_step_checkpoint_is_the_newest_version(tmp_path):
    """Without last.ckpt the final checkpoint is the highest step, and of two step<N> files the -v1 (a later
    history's), which sorts before step<N>.ckpt by name."""
    from tools.runs import _final_checkpoint

    (tmp_path / "checkpoints").mkdir()
    for name in ("step0000090.ckpt", "step0000100.ckpt", "step0000100-v1.ckpt"):
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    os.utime(tmp_path / "checkpoints" / "step0000090.ckpt", (2e9, 2e9))  # a copy that kept no modification times
    assert _final_checkpoint(tmp_path).name == "step0000100-v1.ckpt"
    from model.checkpoint import find_checkpoint

    assert find_checkpoint(tmp_path).name == "step0000100-v1.ckpt"  # evaluate.py ckpt=<run dir> scores the same


def test_evals_of_the_final_checkpoint_only_newest_first(tmp_path, capsys):
    import time

    from tools.runs import read_evals

    run = _fake_run(tmp_path, "r", ckpts=("last", "step0000010"),
                    evals=[("probes", "last.ckpt", 0.9), ("probes_step10", "step0000010.ckpt", 0.1)])
    assert read_evals(run) == {"probe_needle/acc": 0.9}  # the intermediate checkpoint's score is not the run's
    time.sleep(0.01)
    (run / "eval" / "probes_again").mkdir()
    (run / "eval" / "probes_again" / "results.json").write_text(json.dumps(
        {"checkpoint": str(run / "checkpoints" / "last.ckpt"),
         "results": [{"task": "probe_needle", "metric": "acc", "value": 0.8}]}))
    assert read_evals(run) == {"probe_needle/acc": 0.8} and "probes_again" in capsys.readouterr().err


def test_evals_of_an_earlier_last_checkpoint_or_another_attention_are_not_the_runs(tmp_path, capsys):
    """A run resumed in its own folder rewrites last.ckpt and keeps eval/: the shorter run's score was shown beside
    the longer run's steps. A score at another window was pooled into the trained window's group."""
    from tools.runs import load_run

    run = _fake_run(tmp_path, "r", window=8, rows=[(0, 29, 2.0, 960, "")])  # 30 steps
    now = (run / "checkpoints" / "last.ckpt").stat().st_mtime_ns
    for folder, mtime, step, window, value in (("old", now - 1, 10, 8, 0.25), ("final", now, 30, 8, 0.5),
                                               ("wide", now, 30, 64, 0.7), ("legacy", None, None, 8, 0.5)):
        (run / "eval" / folder).mkdir(parents=True)
        (run / "eval" / folder / "results.json").write_text(json.dumps(
            {"checkpoint": str(run / "checkpoints" / "last.ckpt"), "checkpoint_mtime_ns": mtime,
             "checkpoint_step": step, "attention": {"kind": "sa", "window": window},
             "results": [{"task": "probe_needle", "metric": "acc", "value": value}]}))
    assert load_run(run).evals == {"probe_needle/acc": 0.5, "probe_needle/acc [window=64]": 0.7}
    assert "scored an earlier last.ckpt (step 10)" in capsys.readouterr().err
    # a copied run folder: every mtime is new, the steps are those scored
    import shutil

    copy = shutil.copytree(run, tmp_path / "copy", copy_function=shutil.copy)
    (copy / "eval" / "old" / "results.json").unlink()
    assert load_run(copy).evals == {"probe_needle/acc": 0.5, "probe_needle/acc [window=64]": 0.7}
    assert "scored an earlier" not in capsys.readouterr().err


def test_evals_of_an_abandoned_attempt_at_the_same_step_are_not_the_runs(tmp_path, capsys):
    """A restart from an earlier checkpoint that ends at the scored step rewrites last.ckpt with other weights: the
    step alone kept the abandoned attempt's score. A copy of the same file (a new mtime) keeps it."""
    import torch

    from tools.runs import read_evals

    run = _fake_run(tmp_path, "r", window=8, rows=[(0, 29, 2.0, 960, "")])
    last = run / "checkpoints" / "last.ckpt"
    torch.save({"global_step": 30, "attempt": "first"}, last)
    (run / "eval" / "x").mkdir(parents=True)
    (run / "eval" / "x" / "results.json").write_text(json.dumps(
        {"checkpoint": str(last), "checkpoint_mtime_ns": last.stat().st_mtime_ns - 1, "checkpoint_step": 30,
         "checkpoint_attempt": "first", "results": [{"task": "probe_needle", "metric": "acc", "value": 0.5}]}))
    assert read_evals(run, steps=30) == {"probe_needle/acc": 0.5}  # a copy: same attempt, another mtime
    torch.save({"global_step": 20, "attempt": "first"}, last)  # re-saved from the attempt's own step 20, untrained
    assert read_evals(run, steps=20) == {}
    torch.save({"global_step": 30, "attempt": "restart"}, last)
    assert read_evals(run, steps=30) == {}
    assert "scored an earlier last.ckpt (step 30)" in capsys.readouterr().err
    last.write_bytes(b"not a checkpoint")  # unreadable: the step decides, as for files without an attempt
    assert read_evals(run, steps=30) == {"probe_needle/acc": 0.5}


def test_evals_of_the_last_steps_own_checkpoint_are_the_runs(tmp_path):
    """train.py leaves step<N>.ckpt beside last.ckpt at the last step: a score of that file (or of its kept weights)
    was dropped as an intermediate checkpoint's, without a word. An earlier step's, or another attempt's, is not the
    run's."""
    import torch

    from tools.runs import read_evals

    run = _fake_run(tmp_path, "r", window=8, rows=[(0, 29, 2.0, 960, "")], ckpts=("step0000020", "step0000030"))
    last = run / "checkpoints" / "last.ckpt"
    torch.save({"global_step": 30, "attempt": "a"}, last)
    for folder, scored, step, attempt, value in (("final", "checkpoints/step0000030.ckpt", 30, "a", 0.5),
                                                 ("weights", "weights/step0000030.pt", 30, "a", 0.5),
                                                 ("earlier", "checkpoints/step0000020.ckpt", 20, "a", 0.1),
                                                 ("other", "checkpoints/step0000030.ckpt", 30, "b", 0.3)):
        (run / "eval" / folder).mkdir(parents=True)
        (run / "eval" / folder / "results.json").write_text(json.dumps(
            {"checkpoint": str(run / scored), "checkpoint_mtime_ns": 1, "checkpoint_step": step,
             "checkpoint_attempt": attempt, "results": [{"task": "probe_needle", "metric": "acc", "value": value}]}))
    assert read_evals(run, steps=30) == {"probe_needle/acc": 0.5}


def test_a_half_written_last_row_of_metrics_is_not_read(tmp_path):
    """A run killed mid-write (or read while writing) ends metrics.csv in part of a row: a cut step went backwards
    and dropped the run's history as an abandoned attempt's, a cut value crashed."""
    from tools.runs import read_metrics

    run = _fake_run(tmp_path, "r", rows=[(0, 9, 2.0, 320, ""), (0, 19, 1.5, 640, ""), (0, 19, "", "", 1.7)])
    whole, text = read_metrics(run / "metrics.csv"), (run / "metrics.csv").read_text()
    for tail in ("0,1", "0,29,1.2,9", "0,29,1e-"):
        (run / "metrics.csv").write_text(text + tail)
        assert read_metrics(run / "metrics.csv") == whole
    (run / "metrics.csv").write_text("epoch,st")  # not even a whole header yet
    assert read_metrics(run / "metrics.csv") == {}


def test_evals_at_another_eval_seed_are_keyed_apart(tmp_path):
    """Another draw of SA's permutations (attention.eval_seed=5) shared seed 0's column, and the newer file won."""
    from tools.runs import read_evals

    run = _fake_run(tmp_path, "r", window=8, rows=[(0, 9, 2.0, 960, "")])
    for folder, attention, value in (
            ("own", {"kind": "sa", "window": 8, "eval_seed": 0}, 0.5),  # evaluation.runner
            ("seed5", {"kind": "sa", "window": 8, "eval_seed": 5}, 0.4),
            ("probes_seed7_3seeds", {"kind": "sa", "window": 8, "eval_seeds": [7, 8, 9]}, 0.3),  # probe_eval
            ("swa_seed5", {"kind": "swa", "window": 8, "eval_seed": 5}, 0.2)):  # draws no permutation
        (run / "eval" / folder).mkdir(parents=True)
        (run / "eval" / folder / "results.json").write_text(json.dumps(
            {"checkpoint": str(run / "checkpoints" / "last.ckpt"), "attention": attention,
             "trained_attention": {"kind": "sa", "window": 8, "eval_seed": 0},
             "results": [{"task": "probe_needle", "metric": "acc", "value": value}]}))
    assert read_evals(run) == {"probe_needle/acc": 0.5, "probe_needle/acc [eval_seed=5]": 0.4,
                               "probe_needle/acc [eval_seed=7, seeds=3]": 0.3, "probe_needle/acc [kind=swa]": 0.2}
    # a run evaluated by default at eval_seed 5 (its config's): that is its own column
    (run / "eval" / "own" / "results.json").unlink()
    trained = json.loads((run / "eval" / "seed5" / "results.json").read_text())
    trained.pop("trained_attention")  # an older file: the run's config says which seed is its own
    (run / "eval" / "seed5" / "results.json").write_text(json.dumps(trained))
    assert read_evals(run, {"kind": "sa", "window": 8, "eval_seed": 5})["probe_needle/acc"] == 0.4


def test_evals_past_the_trained_context_are_keyed_apart(tmp_path):
    from tools.runs import read_evals

    run = _fake_run(tmp_path, "r", window=8, rows=[(0, 9, 2.0, 960, "")])
    for folder, max_length, value in (("trained", 64, 5.0), ("long", 256, 9.0), ("before", None, 5.0)):
        (run / "eval" / folder).mkdir(parents=True)
        (run / "eval" / folder / "results.json").write_text(json.dumps(
            {"checkpoint": str(run / "checkpoints" / "last.ckpt"), "trained_context": 64, "max_length": max_length,
             "results": [{"task": "wikitext", "metric": "word_perplexity", "value": value}]}))
    assert read_evals(run) == {"wikitext/word_perplexity": 5.0, "wikitext/word_perplexity [context=256]": 9.0}


def test_evals_in_bf16_or_over_several_seeds_are_keyed_apart(tmp_path, capsys):
    """eval.dtype=bfloat16 and eval.num_seeds=2 replaced the fp32 one-draw score in its column (a warning only)."""
    from tools.runs import read_evals

    run = _fake_run(tmp_path, "r", window=8, rows=[(0, 9, 2.0, 960, "")])
    for age, (folder, extra, value) in enumerate((("fp32", {"dtype": "float32", "seeds": [0]}, 0.5),
                                                  ("bf16", {"dtype": "bfloat16", "seeds": [0]}, 0.49),
                                                  ("two", {"dtype": "float32", "seeds": [0, 1]}, 0.47))):
        (run / "eval" / folder).mkdir(parents=True)
        (run / "eval" / folder / "results.json").write_text(json.dumps(
            {"checkpoint": str(run / "checkpoints" / "last.ckpt"), "attention": {"kind": "sa", "window": 8,
                                                                                 "eval_seed": 0},
             **extra, "results": [{"task": "lambada_openai", "metric": "acc", "value": value}]}))
        os.utime(run / "eval" / folder / "results.json", (1e9 + age, 1e9 + age))
    assert read_evals(run) == {"lambada_openai/acc": 0.5, "lambada_openai/acc [dtype=bfloat16]": 0.49,
                               "lambada_openai/acc [seeds=2]": 0.47}
    assert "warning" not in capsys.readouterr().err


def test_a_damaged_file_leaves_out_what_it_holds_not_the_table(tmp_path, capsys):
    """A results.json holding a list or a non-number, a metrics.csv row without a step, a config.yaml that is no
    mapping: each stopped tools.compare with a traceback."""
    from tools.compare import compare
    from tools.runs import read_evals, read_metrics

    run = _fake_run(tmp_path, "r", rows=[(0, 9, 2.0, 320, ""), (0, 19, 1.5, 640, "")],
                    evals=[("quick", "last.ckpt", 0.4)])
    for folder, text in (("list", "[1, 2]"), ("null", "null"), ("words", json.dumps(
            {"checkpoint": str(run / "checkpoints" / "last.ckpt"),
             "results": [{"task": "probe_needle", "metric": "acc", "value": "n/a"}, 3]})),
            ("seeds", json.dumps({"checkpoint": str(run / "checkpoints" / "last.ckpt"), "seeds": 3, "attention": [],
                                  "results": [{"task": "probe_needle", "metric": "acc", "value": 0.4}]}))):
        (run / "eval" / folder).mkdir()
        (run / "eval" / folder / "results.json").write_text(text)
    assert read_evals(run) == {"probe_needle/acc": 0.4}
    whole = read_metrics(run / "metrics.csv")
    lines = (run / "metrics.csv").read_text().splitlines(keepends=True)
    (run / "metrics.csv").write_text("".join(lines[:2] + ["garbage,,\n", "0,15,oops,,\n"] + lines[2:]))
    assert read_metrics(run / "metrics.csv") == whole
    broken = _fake_run(tmp_path, "broken", rows=[(0, 9, 2.0, 320, "")])
    (broken / "config.yaml").write_text("- just\n- a list\n")
    result = compare([tmp_path], tmp_path / "out", plots=False)
    assert [row["run"] for row in result["rows"]] == ["r"]
    assert "skipping run" in capsys.readouterr().err


def test_few_shot_scores_are_keyed_apart_from_zero_shot(tmp_path):
    from tools.runs import read_evals

    run = _fake_run(tmp_path, "r", window=8, rows=[(0, 9, 2.0, 960, "")])
    # oldest first: tasks at their own shots (a dict), then zero-shot, then five-shot
    for age, (folder, shots, value) in enumerate((("own", {"mmlu": 0, "gsm8k": 5}, 0.26), ("zero", 0, 0.25),
                                                  ("five", 5, 0.31))):
        (run / "eval" / folder).mkdir(parents=True)
        (run / "eval" / folder / "results.json").write_text(json.dumps(
            {"checkpoint": str(run / "checkpoints" / "last.ckpt"), "num_fewshot": shots,
             "results": [{"task": "mmlu", "metric": "acc", "value": value}]}))
        os.utime(run / "eval" / folder / "results.json", (1e9 + age, 1e9 + age))
    # five-shot never replaces the zero-shot score; a task's own shots are its usual score
    assert read_evals(run) == {"mmlu/acc": 0.25, "mmlu/acc [shots=5]": 0.31}


def test_steps_tokens_and_curves_of_runs_that_stop_between_log_rows(tmp_path):
    from tools.runs import load_run

    # log every 10, validate every 10 and on the final weights: 25 steps of 32 tokens; the first attempt ran to
    # step 39 and was resumed from step 19 (its rows from 20 on are dropped)
    rows = [(0, 0, "", "", 3.0), (0, 9, 2.5, 320, ""), (0, 10, "", "", 2.4), (0, 19, 2.2, 640, ""),
            (0, 20, "", "", 9.9), (0, 29, 9.9, 960, ""), (0, 30, "", "", 9.9), (0, 39, 9.9, 1280, ""),
            (0, 19, 2.2, 640, ""), (0, 20, "", "", 2.1), (0, 25, "", "", 2.0)]
    run = load_run(_fake_run(tmp_path, "r", max_steps=25, rows=rows))
    steps, values = run.series("val/loss")
    assert steps == [0, 10, 20, 25] and values == [3.0, 2.4, 2.1, 2.0]
    assert run.steps == 25 and run.tokens_at(steps) == [0, 320, 640, 800]
    # the same run as written before 2026-12-02: Lightning labelled the periodic validations one step early
    rows = [(0, 0, "", "", 3.0), (0, 9, 2.5, 320, ""), (0, 9, "", "", 2.4), (0, 19, 2.2, 640, ""),
            (0, 29, 9.9, 960, ""), (0, 39, 9.9, 1280, ""), (0, 29, "", "", 9.9),
            (0, 19, 2.2, 640, ""), (0, 19, "", "", 2.1), (0, 25, "", "", 2.0)]
    old = load_run(_fake_run(tmp_path, "old", max_steps=25, rows=rows))
    steps, values = old.series("val/loss")
    assert steps == [0, 9, 19, 25] and values == [3.0, 2.4, 2.1, 2.0]
    assert old.steps == 25 and old.tokens_at(steps) == [0, 320, 640, 800]
    # validating every step: the last validation follows the last training row now, sits at its step before
    every = {"trainer": {"val_every_n_steps": 1}}
    now_rows = [(0, 0, "", "", 3.0), (0, 0, 2.5, 32, ""), (0, 1, "", "", 2.4), (0, 1, 2.3, 64, ""),
                (0, 2, "", "", 2.2)]
    old_rows = [(0, 0, "", "", 3.0), (0, 0, 2.5, 32, ""), (0, 0, "", "", 2.4), (0, 1, 2.3, 64, ""),
                (0, 1, "", "", 2.2)]
    for name, rows, behind in (("every1_now", now_rows, 2), ("every1_old", old_rows, 2)):
        one = load_run(_fake_run(tmp_path, name, max_steps=2, rows=rows))
        one.config.update(every)
        assert one.steps_behind(max(one.metrics["val/loss"]), "val/loss") == behind
    # a final validation at 29 (= 3 * 10 - 1) is the final weights' in a run labelled the current way
    late = load_run(_fake_run(tmp_path, "late", max_steps=29, rows=rows[:2] + [(0, 10, "", "", 2.4),
                                                                                 (0, 29, "", "", 2.0)]))
    assert late.tokens_at([10, 29]) == [320, 29 * 32]
    # one validation after step 0: told by the training row at its step
    for name, train_row, label, behind in (("one_old", (0, 9, 2.5, 320, ""), 9, 10),
                                           ("one", (0, 8, 2.5, 288, ""), 9, 9)):
        one = load_run(_fake_run(tmp_path, name, max_steps=10, rows=[(0, 0, "", "", 3.0), train_row,
                                                                      (0, label, "", "", 2.4)]))
        assert one.steps == behind and one.tokens_at([label]) == [behind * 32], name
    short = load_run(_fake_run(tmp_path, "short", max_steps=2, rows=[(0, 0, "", "", 3.0), (0, 2, "", "", 2.9)]))
    assert short.steps == 2 and short.tokens_at([0, 2]) == [0, 64]  # no train row: tokens from the config


def test_summary_survives_a_diverged_seed(tmp_path):
    from tools.compare import compare

    _fake_run(tmp_path, "a", seed=0, max_steps=10, rows=[(0, 9, 2.0, 320, ""), (0, 9, "", "", 2.1)])
    _fake_run(tmp_path, "b", seed=1, max_steps=10, rows=[(0, 9, 2.0, 320, ""), (0, 9, "", "", "nan")])
    text = compare([str(tmp_path)], tmp_path / "out", plots=False)["markdown"]
    assert "| sa w=8 | 2 | nan ± nan |" in text


def test_a_run_that_stopped_early_is_marked(tmp_path, capsys):
    """A killed run's row looked like a finished one: 430 steps of 1500, its val loss from step 400."""
    from tools.compare import compare

    _fake_run(tmp_path, "done", max_steps=10, rows=[(0, 9, 2.0, 320, ""), (0, 10, "", "", 2.1)])
    _fake_run(tmp_path, "killed", seed=1, max_steps=30, rows=[(0, 9, 2.0, 320, ""), (0, 10, "", "", 2.1)])
    text = compare([str(tmp_path)], tmp_path / "out", plots=False)["markdown"]
    assert "| done | sa | 8 | 0 | 10 |" in text and "| killed | sa | 8 | 1 | 10/30 |" in text
    assert "killed stopped at step 10 of 30" in capsys.readouterr().err


def test_a_run_that_stopped_early_is_not_averaged_with_finished_seeds(tmp_path):
    """A seed killed at step 10 of 30 entered its configuration's mean with step-10 losses."""
    from tools.compare import compare

    for name, seed, loss in (("a", 0, 2.0), ("b", 1, 2.2)):
        _fake_run(tmp_path, name, seed=seed, max_steps=30, rows=[(0, 29, loss, 960, ""), (0, 30, "", "", loss)])
    _fake_run(tmp_path, "c", seed=2, max_steps=30, rows=[(0, 9, 3.9, 320, ""), (0, 10, "", "", 3.9)])
    _fake_run(tmp_path, "d", seed=3, max_steps=30, rows=[(0, 19, 3.1, 640, ""), (0, 20, "", "", 3.1)])
    text = compare([str(tmp_path)], tmp_path / "out", plots=False)["markdown"]
    assert "| sa w=8 | 2 | 2.1000 ± 0.1414 |" in text  # nor with each other, at different steps
    assert "| sa w=8 [stopped at 10/30] | 1 | 3.9000 |" in text
    assert "| sa w=8 [stopped at 20/30] | 1 | 3.1000 |" in text
    assert "Note: c stopped at step 10 of 30" in (tmp_path / "out" / "compare.md").read_text()


def test_where_a_run_was_launched_does_not_split_its_seeds():
    """config.yaml holds data.cache_dir resolved ($PWD/.cache): seeds launched from two folders were two configs."""
    from tools.runs import flat_config

    a = flat_config({"seed": 0, "data": {"cache_dir": "/x/.cache", "seq_len": 64}, "optim": {"lr": 1e-3}})
    b = flat_config({"seed": 1, "data": {"cache_dir": "/y/.cache", "seq_len": 64}, "optim": {"lr": 1e-3}})
    assert a == b == {"data.seq_len": "64", "optim.lr": "0.001"}
    # nor how it was computed: a seed rerun with recomputed blocks and a chunked loss to fit a smaller GPU
    c = flat_config({"seed": 2, "data": {"seq_len": 64, "val_batch_size": 4}, "optim": {"lr": 1e-3},
                     "trainer": {"activation_checkpointing": True, "loss_chunk_tokens": 4096}})
    assert c == a
    # data=probes trains on a file under paths.cache_dir, which config.yaml holds resolved too
    probes = [flat_config({"seed": i, "paths": {"cache_dir": f"/{d}/.cache"},
                           "data": {"source": {"paths": [f"/{d}/.cache/probes/kv-s0.jsonl", "/books/a.txt"]}}})
              for i, d in enumerate(("x", "y"))]
    assert probes[0] == probes[1] == {
        "data.source.paths": json.dumps(["${paths.cache_dir}/probes/kv-s0.jsonl", "/books/a.txt"])}


def test_the_tokens_per_s_column_is_the_median_over_the_run(tmp_path):
    """tokens/s is the median of the run's rows: one slow or fast row (a checkpoint save, a warm cache) was the
    column when it happened to be the last."""
    from tools.compare import compare

    run = _fake_run(tmp_path, "r", max_steps=30)
    (run / "metrics.csv").write_text("epoch,step,train/loss,train/tokens,train/tokens_per_s\n"
                                     "0,9,2.0,320,1\n0,19,1.9,640,3\n0,29,1.8,960,100\n")
    result = compare([str(run)], tmp_path / "out", plots=False)
    assert result["rows"][0]["tokens_per_s"] == 3 and "| 1.8000 | — | — | 3 |" in result["markdown"]


def test_the_band_of_the_loss_plot_is_the_min_and_max_across_seeds():
    """The shaded band is min-max across the runs at each x, the thick line their mean; a run that stopped early
    leaves the later points to the others."""
    from tools.compare import _mean_band

    xs, mean, lo, hi = _mean_band([([0, 1, 2], [1.0, 5.0, 3.0]), ([0, 1], [3.0, 1.0])])
    assert xs.tolist() == [0, 1, 2] and mean.tolist() == [2.0, 3.0, 3.0]
    assert lo.tolist() == [1.0, 1.0, 3.0] and hi.tolist() == [3.0, 5.0, 3.0]
    assert _mean_band([([], [])]) is None


def test_tokens_per_step_from_the_config_counts_every_device_and_node(tmp_path):
    """A run too short to log train/tokens takes its tokens per step from the config: each of the devices x nodes
    ranks trains on its own batches, so a 2-GPU run's tokens were halved if the devices were left out."""
    from tools.runs import load_run

    run = load_run(_fake_run(tmp_path, "r", max_steps=2, rows=[(0, 0, "", "", 3.0), (0, 2, "", "", 2.9)],
                             trainer={"devices": 2, "num_nodes": 3, "accumulate_grad_batches": 2}))
    assert run.tokens_per_step() == 2 * 16 * 2 * 2 * 3
    assert run.tokens_at([0, 2]) == [0, 2 * 384]


def test_a_restart_keeps_the_rows_logged_at_its_own_step(tmp_path):
    """A restart from the step-20 checkpoint (a training row at 20 after rows up to 30) drops the abandoned rows
    after step 20; the validation at 20 scored the very weights the restart resumed from, and is kept."""
    from tools.runs import read_metrics

    run = _fake_run(tmp_path, "r", rows=[(0, 19, 2.2, 640, ""), (0, 20, "", "", 2.1), (0, 29, 9.9, 960, ""),
                                         (0, 30, "", "", 9.9), (0, 20, 2.0, 672, "")])
    metrics = read_metrics(run / "metrics.csv")
    assert metrics["val/loss"] == {20: 2.1}
    assert metrics["train/loss"] == {19: 2.2, 20: 2.0}


def test_a_config_key_only_one_seed_has_splits_the_group(tmp_path):
    """A key set in one run's config and absent from the other's (an option added since, or a config from another
    version of train.py) is a difference: the two were pooled as seeds of one configuration."""
    from tools.compare import compare

    rows = [(0, 9, 2.0, 320, ""), (0, 9, "", "", 2.1)]
    _fake_run(tmp_path, "a", seed=0, rows=rows, trainer={"gradient_clip_val": 1.0})
    _fake_run(tmp_path, "b", seed=1, rows=rows)
    groups = {r["run"]: r["group"] for r in compare([str(tmp_path)], tmp_path / "out", plots=False)["rows"]}
    assert groups == {"a": "sa w=8 (trainer.gradient_clip_val=1.0)", "b": "sa w=8 (trainer.gradient_clip_val=—)"}


def test_a_run_one_step_short_is_marked_stopped_early(tmp_path):
    """29 of 30 planned steps is a run that stopped early, however close to the end."""
    from tools.compare import compare

    _fake_run(tmp_path, "r", max_steps=30, rows=[(0, 28, 2.0, 928, "")])
    result = compare([str(tmp_path)], tmp_path / "out", plots=False)
    assert result["rows"][0]["steps"] == 29 and "| r | sa | 8 | 0 | 29/30 |" in result["markdown"]


def test_a_training_row_at_step_s_follows_s_plus_one_steps(tmp_path):
    """The training row at step s is logged during step s + 1: a run whose last row is at 19 ran 20 steps, and the
    loss at 9 was measured after 10 steps' tokens."""
    from tools.runs import load_run

    run = load_run(_fake_run(tmp_path, "r", max_steps=20, rows=[(0, 9, 2.5, 320, ""), (0, 19, 2.2, 640, "")]))
    assert run.steps == 20 and run.tokens_per_step() == 32
    assert run.tokens_at([9, 19], "train/loss") == [10 * 32, 20 * 32]


def test_a_tie_between_early_and_current_validation_labels_reads_as_current(tmp_path):
    """A run trained 9 steps (a final validation at 9) and then continued to 20 (validations at 10 and 20) holds one
    label at k * every - 1 and one at k * every. Early labels come only from files written before 2026-12-02 and
    are the exception, taken only on a majority of the periodic validations: a tie reads as the current labels, so
    the validation at 9 stays after 9 steps (an early reading made it 10, the same x as the one at 10)."""
    from tools.runs import load_run

    rows = [(0, 0, "", "", 3.0), (0, 9, "", "", 2.6), (0, 9, 2.5, 320, ""), (0, 10, "", "", 2.4),
            (0, 19, 2.2, 640, ""), (0, 20, "", "", 2.1)]
    run = load_run(_fake_run(tmp_path, "r", max_steps=20, rows=rows))
    assert not run._periodic_val_labelled_early()
    assert run.steps == 20 and run.tokens_at([0, 9, 10, 20]) == [0, 9 * 32, 10 * 32, 20 * 32]
