"""Training end to end on CPU with the real Lightning Trainer and the real configs, at tiny sizes."""

import contextlib
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY, compose_train
from model.lightning_module import LitDecoder, NonFiniteLossError
from tools.runs import read_metrics as read_run_metrics
from train import train


def read_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.csv -> {metric: {step: value}}."""
    out: dict[str, dict[int, float]] = {}
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out


@pytest.mark.parametrize("attention", ["full", "swa", "sa", "gated_sa_swa"])
def test_each_variant_trains_and_its_loss_falls(attention, tmp_path, corpus_file, data_cache):
    logger = ["logger=wandb"] if attention == "gated_sa_swa" else []
    cfg = compose_train(TINY + [f"attention={attention}", "attention.window=8", "trainer.max_steps=30",
                                "trainer.val_every_n_steps=30", "trainer.checkpoint_every_n_steps=15"] + logger,
                        tmp_path, corpus_file, data_cache)
    metrics = train(cfg)
    assert metrics["val/loss"] < metrics["val/loss_at_start"] - 0.5
    for name in ("checkpoints/last.ckpt", "checkpoints/step0000015.ckpt", "config.yaml", "metrics.csv",
                 "git_revision.txt"):
        assert (tmp_path / name).is_file(), name
    logged = read_metrics(tmp_path)
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/tokens", "train/tokens_per_s", "val/loss",
                "val/ppl"):
        assert key in logged, key
    assert logged["val/ppl"].keys() == logged["val/loss"].keys() == {0, 30}
    for step, loss in logged["val/loss"].items():  # perplexity in nats' base, at every validation
        assert logged["val/ppl"][step] == pytest.approx(math.exp(loss), rel=1e-5), step
    assert logged["train/tokens"][29] == 30 * 4 * 64  # steps x batch x seq_len, after the 30th step
    if logger:
        assert list((tmp_path / "wandb").glob("offline-run-*")), "an offline W&B run is written"
    gates = [key for key in logged if key.startswith("gates/")]
    if attention == "gated_sa_swa":  # how open each path's gates are, per layer, at every validation
        assert sorted(gates) == ["gates/sa/layer00", "gates/sa/layer01", "gates/swa/layer00", "gates/swa/layer01"]
        assert all(logged[key][0] == 0.5 for key in gates)  # zero-initialised gates: sigmoid(0)
        assert any(abs(logged[key][30] - 0.5) > 1e-3 for key in gates)  # trained
    else:
        assert gates == []
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == 30 and any(k.startswith("model.blocks.0.attn") for k in ckpt["state_dict"])


def test_resumed_run_reproduces_uninterrupted_losses(tmp_path, corpus_file, data_cache):
    # Stopping at 2 of 8 (before half-way) and at 5 (after it, not a checkpoint multiple of the first): Lightning
    # counts the batches already run into the epoch's length, so a loader that reported only the remaining ones
    # ended the epoch early and replayed old batches. Two micro-batches per step: their permutations resume too.
    # Validating every 3 steps: the first attempt's final validation (after step 2 or 5) and the resumed run's next
    # one (after step 3 or 6) were both labelled 2 or 5, and one of them was lost from the curve.
    common = TINY + ["attention=gated_sa_swa", "attention.window=8", "optim.schedule_steps=8",
                     "trainer.val_every_n_steps=3", "trainer.accumulate_grad_batches=2"]
    full = read_metrics_after(compose_train(common + ["trainer.max_steps=8"], tmp_path / "a", corpus_file, data_cache))
    for stop in (2, 5):
        run = tmp_path / f"stop{stop}"
        every = [f"trainer.checkpoint_every_n_steps={stop}"]
        train(compose_train(common + every + [f"trainer.max_steps={stop}"], run, corpus_file, data_cache))
        resumed_cfg = compose_train(common + every + ["trainer.max_steps=8", "resume=auto"], run, corpus_file,
                                    data_cache)
        train(resumed_cfg)
        # the checkpoint the resume started from still holds the step boundary: re-saved after the first
        # micro-batch of step stop + 1 (global_step still read stop), a resume from it was one micro-batch off
        saved = torch.load(run / "checkpoints" / f"step{stop:07d}.ckpt", weights_only=True, map_location="cpu")
        progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
        assert progress["ready"] == 2 * stop, (stop, progress)  # two micro-batches per step
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(  # no last-v1.ckpt beside them
            {f"step{k:07d}.ckpt" for k in range(stop, 9, stop)} | {"step0000008.ckpt", "last.ckpt"}), stop
        # metrics.csv holds the whole run: the first attempt's rows, then the resumed ones (Lightning's own CSV
        # logger deleted the first attempt's)
        logged = read_run_metrics(run / "metrics.csv")
        history = logged["train/loss"]
        assert sorted(history) == list(range(8)), stop
        for step in history:
            assert abs(history[step] - full["train/loss"][step]) <= 1e-6, (stop, step)
        assert sorted(full["val/loss"]) == [0, 3, 6, 8]
        assert sorted(logged["val/loss"]) == sorted([0, 3, 6, 8, stop]), stop
        for step in full["val/loss"]:
            assert abs(logged["val/loss"][step] - full["val/loss"][step]) <= 1e-6, (stop, step)


def test_a_resume_validates_the_checkpoints_step_when_its_validation_was_never_logged(tmp_path, corpus_file,
                                                                                     data_cache):
    """Inside fit step N's checkpoint is written before step N's validation, and a resume goes on to step N + 1: a
    run killed during that validation (or resumed in a new folder) had no val/loss at N, a gap in every curve."""
    common = TINY + ["attention=sa", "attention.window=8", "optim.schedule_steps=6", "trainer.val_every_n_steps=2",
                     "trainer.checkpoint_every_n_steps=2"]
    full = read_metrics_after(compose_train(common + ["trainer.max_steps=6"], tmp_path / "full", corpus_file,
                                            data_cache))
    run = tmp_path / "run"
    train(compose_train(common + ["trainer.max_steps=4"], run, corpus_file, data_cache))
    with open(run / "metrics.csv") as f:  # killed during step 4's validation: its row was never written
        rows = list(csv.DictReader(f))
    killed = [r for r in rows if not (r["step"] == "4" and r["val/loss"])]
    assert len(killed) == len(rows) - 1
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(killed)
    train(compose_train(common + ["trainer.max_steps=6", "resume=auto"], run, corpus_file, data_cache))
    logged = read_run_metrics(run / "metrics.csv")
    assert sorted(logged["val/loss"]) == sorted(full["val/loss"]) == [0, 2, 4, 6]
    for key in ("val/loss", "train/loss"):
        for step, value in full[key].items():
            assert logged[key][step] == pytest.approx(value, abs=1e-6), (key, step)
    # logged already: not run again (one row per step)
    train(compose_train(common + ["trainer.max_steps=8", "optim.schedule_steps=8", "resume=auto"], run, corpus_file,
                        data_cache))
    with open(run / "metrics.csv") as f:
        assert [r["step"] for r in csv.DictReader(f) if r["val/loss"]].count("6") == 1


def test_a_relaunch_of_a_finished_run_trains_validates_and_evaluates_nothing_again(tmp_path, corpus_file,
                                                                                   data_cache, capsys):
    """A requeued job or a sweep run again: it validated its final weights again (a second row at the same step)
    and ran the whole eval.after_train suite again. A suite scored with other settings, or with tasks skipped,
    is scored again."""
    from test_evaluation import make_truth, wiki_articles, write_evaldata

    evaldata = write_evaldata(tmp_path / "evaldata", make_truth(), wiki_articles(2))
    common = TINY + ["attention=sa", "attention.window=8", "trainer.max_steps=3", "trainer.val_every_n_steps=2",
                     "trainer.checkpoint_every_n_steps=2", "eval.name=quick", "eval.limit=2"]
    run = tmp_path / "run"
    results = run / "eval" / "quick" / "results.json"
    first = train(compose_train(common + ["eval.after_train=true"], run, corpus_file, data_cache))
    assert json.loads(results.read_text())["results"] == []  # offline without eval.data_dir: every task skipped
    scored = common + ["resume=auto", "eval.after_train=true", f"eval.data_dir={evaldata}"]
    capsys.readouterr()
    again = train(compose_train(scored, run, corpus_file, data_cache))
    err = capsys.readouterr().err
    assert "resume: the run finished at step 3 (trainer.max_steps=3)" in err
    assert "eval: the suite's scores" not in err and "eval/lambada_openai/acc" in again  # scored now
    with open(run / "metrics.csv") as f:
        assert [r["step"] for r in csv.DictReader(f) if r["val/loss"]] == ["0", "2", "3"]
    assert again["val/loss"] == pytest.approx(first["val/loss"], abs=1e-6)  # what a sweeper reads: the logged one
    written = results.stat().st_mtime_ns
    train(compose_train(scored, run, corpus_file, data_cache))
    assert f"eval: the suite's scores of step 3 are in {results}" in capsys.readouterr().err
    assert results.stat().st_mtime_ns == written
    train(compose_train(scored + ["eval.limit=3"], run, corpus_file, data_cache))  # other settings: scored again
    assert "eval: the suite's scores" not in capsys.readouterr().err
    assert json.loads(results.read_text())["limit"] == 3


def test_a_checkpoint_from_before_shuffled_sampling_resumes_its_random_stream(tmp_path, corpus_file, data_cache,
                                                                              capsys):
    """A checkpoint without data.sampling drew its windows with replacement: its resume goes on drawing them so (the
    losses of an uninterrupted sampling=random run), says so, and records it for the next resume."""
    common = TINY + ["attention=sa", "attention.window=8", "optim.schedule_steps=4", "trainer.val_every_n_steps=4",
                     "trainer.checkpoint_every_n_steps=2"]
    full = read_metrics_after(compose_train(common + ["trainer.max_steps=4", "data.sampling=random"], tmp_path / "a",
                                            corpus_file, data_cache))
    shuffled = read_metrics_after(compose_train(common + ["trainer.max_steps=4"], tmp_path / "b", corpus_file,
                                                data_cache))
    assert shuffled["train/loss"][0] != full["train/loss"][0]  # the two streams differ
    run = tmp_path / "old"
    train(compose_train(common + ["trainer.max_steps=2", "data.sampling=random"], run, corpus_file, data_cache))
    last = run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    del ckpt["hyper_parameters"]["data"]["sampling"]  # as checkpoints were written before the key
    torch.save(ckpt, last)
    capsys.readouterr()
    train(compose_train(common + ["trainer.max_steps=4", "resume=auto"], run, corpus_file, data_cache))
    err = capsys.readouterr().err
    assert "data.sampling: random, as the checkpoint trained" in err
    assert "differs from the checkpoint" not in err  # the missing key is the old default, not a change
    history = read_run_metrics(run / "metrics.csv")["train/loss"]
    for step in (2, 3):
        assert abs(history[step] - full["train/loss"][step]) <= 1e-6, step
    assert torch.load(last, weights_only=True)["hyper_parameters"]["data"]["sampling"] == "random"
    # and so does the next resume (its checkpoint has the key now; the config's default is still shuffled)
    more = common[:-1] + ["trainer.checkpoint_every_n_steps=3"]
    full = read_metrics_after(compose_train(more + ["trainer.max_steps=6", "data.sampling=random"], tmp_path / "a6",
                                            corpus_file, data_cache))
    capsys.readouterr()
    train(compose_train(more + ["trainer.max_steps=6", "resume=auto"], run, corpus_file, data_cache))
    assert "data.sampling: random, as the checkpoint trained" in capsys.readouterr().err
    history = read_run_metrics(run / "metrics.csv")["train/loss"]
    for step in (4, 5):
        assert abs(history[step] - full["train/loss"][step]) <= 1e-6, step


def test_a_run_started_from_another_runs_checkpoint_keeps_its_own_history(tmp_path, corpus_file, data_cache):
    common = TINY + ["attention=sa", "attention.window=8", "optim.schedule_steps=4", "trainer.val_every_n_steps=2"]
    train(compose_train(common + ["trainer.max_steps=2"], tmp_path / "first", corpus_file, data_cache))
    second = tmp_path / "second"
    second.mkdir()
    (second / "metrics.csv").write_text("epoch,step,train/loss\n0,0,9.0\n")  # an unrelated earlier run's
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    train(compose_train(common + ["trainer.max_steps=4", f"ckpt_path={ckpt}"], second, corpus_file, data_cache))
    assert (second / "previous-1" / "metrics.csv").read_text() == "epoch,step,train/loss\n0,0,9.0\n"
    assert sorted(read_run_metrics(second / "metrics.csv")["train/loss"]) == [2, 3]


def test_a_fresh_run_in_a_used_folder_moves_the_earlier_run_aside(tmp_path, corpus_file, data_cache):
    """The earlier run's last.ckpt stayed where evaluation after training (and evaluate.py ckpt=<dir>) looks for this
    run's, while Lightning wrote the new one to last-v1.ckpt."""
    common = TINY + ["attention=swa", "attention.window=8", "trainer.checkpoint_every_n_steps=2"]
    run = tmp_path / "run"
    train(compose_train(common + ["trainer.max_steps=4"], run, corpus_file, data_cache))
    train(compose_train(common + ["trainer.max_steps=2"], run, corpus_file, data_cache))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "step0000002.ckpt"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    earlier = run / "previous-1"
    assert torch.load(earlier / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert sorted(read_run_metrics(earlier / "metrics.csv")["train/loss"]) == [0, 1, 2, 3]
    assert sorted(read_run_metrics(run / "metrics.csv")["train/loss"]) == [0, 1]
    assert (earlier / "config.yaml").is_file()
    from tools.runs import find_runs

    assert find_runs([tmp_path]) == [run]  # the moved-aside run is not counted again


def test_resuming_with_another_config_is_warned_about_or_refused(tmp_path, corpus_file, data_cache):
    """A longer max_steps silently restarted the learning-rate schedule; another model shape failed in
    load_state_dict with a raw error after the data preparation."""
    from model.config import ConfigError

    common = TINY + ["attention=sa", "trainer.val_every_n_steps=2"]
    run = tmp_path / "run"
    train(compose_train(common + ["attention.window=8", "trainer.max_steps=2"], run, corpus_file, data_cache))
    with pytest.warns(UserWarning, match=r"attention.window: 8 -> 4; learning-rate schedule length: 2 -> 3 steps .*"
                                         r"optim.schedule_steps=2 keeps the old"):
        train(compose_train(common + ["attention.window=4", "trainer.max_steps=3", "resume=auto"], run, corpus_file,
                            data_cache))
    with pytest.raises(ConfigError, match="model.n_layers"):
        train(compose_train(common + ["attention.window=4", "trainer.max_steps=4", "resume=auto", "model.n_layers=3",
                                      "optim.schedule_steps=3"], run, corpus_file, data_cache))
    # another tokenizer, given: the checkpoint's embeddings belong to its own token ids
    from data.prepare import prepare

    other = prepare(compose_train(TINY + ["data.tokenizer.vocab_size=300"], tmp_path / "o", corpus_file,
                                  data_cache).data, data_cache, progress=False).tokenizer_path
    with pytest.raises(ConfigError, match="data.tokenizer.*another tokenizer"):
        train(compose_train(common + ["attention.window=4", "trainer.max_steps=4", "resume=auto",
                                      "optim.schedule_steps=3", f"data.tokenizer.path={other}"], run, corpus_file,
                            data_cache))
    with pytest.warns(UserWarning, match=r"seed: 0 -> 1 .*data.val_windows: 4 -> 2"):
        train(compose_train(common + ["attention.window=4", "trainer.max_steps=4", "resume=auto",
                                      "optim.schedule_steps=3", "seed=1", "data.val_windows=2"], run, corpus_file,
                            data_cache))


def test_a_resume_on_data_prepared_anew_keeps_the_checkpoints_tokenizer(tmp_path, corpus_file, data_cache):
    """Data prepared anew trains another tokenizer (here: another vocabulary size; after an update of the
    preparation format, the same config): the resume tokenizes with the checkpoint's, whose ids the weights know,
    and continues. Before, the weights trained on in silence on new ids (and later, the resume was refused)."""
    common = TINY + ["attention=sa", "attention.window=8", "optim.schedule_steps=6", "trainer.val_every_n_steps=3"]
    run = tmp_path / "run"
    train(compose_train(common + ["trainer.max_steps=3"], run, corpus_file, data_cache))
    first = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["tokenizer"]
    with pytest.warns(UserWarning, match="data.tokenizer"):
        train(compose_train(common + ["trainer.max_steps=5", "resume=auto", "data.tokenizer.vocab_size=300"], run,
                            corpus_file, data_cache))
    from model.lightning_module import same_tokenizer

    after = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert after["global_step"] == 5 and same_tokenizer(after["tokenizer"], first)
    assert sorted(read_run_metrics(run / "metrics.csv")["train/loss"]) == list(range(5))


def test_a_resume_with_another_learning_rate_or_weight_decay_applies_them(tmp_path, corpus_file, data_cache):
    """Lightning restores the optimizer's groups and the schedule's base rate from the checkpoint: the new optim.lr
    and weight_decay were warned about as changed, and then not used."""
    from model.lightning_module import lr_lambda

    common = TINY + ["attention=sa", "attention.window=8", "optim.schedule_steps=6", "trainer.val_every_n_steps=3"]
    run = tmp_path / "run"
    train(compose_train(common + ["trainer.max_steps=3"], run, corpus_file, data_cache))
    with pytest.warns(UserWarning, match=r"optim.lr: 0.003 -> 0.001; optim.weight_decay: 0.01 -> 0.2"):
        train(compose_train(common + ["trainer.max_steps=5", "resume=auto", "optim.lr=1e-3", "optim.weight_decay=0.2"],
                            run, corpus_file, data_cache))
    rates = read_run_metrics(run / "metrics.csv")["train/lr"]
    schedule = lr_lambda(2, 6, 0.1)
    assert rates[2] == pytest.approx(3e-3 * schedule(2)) and rates[3] == pytest.approx(1e-3 * schedule(3))
    assert rates[4] == pytest.approx(1e-3 * schedule(4))
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    decay, no_decay = saved["optimizer_states"][0]["param_groups"]
    assert (decay["weight_decay"], no_decay["weight_decay"], decay["initial_lr"]) == (0.2, 0.0, 1e-3)


def test_learning_rate_schedules():
    from model.lightning_module import lr_lambda

    rates = {name: [lr_lambda(10, 110, 0.1, name, 0.2)(step) for step in range(120)]
             for name in ("cosine", "linear", "wsd", "constant")}
    for name, curve in rates.items():
        assert curve[:10] == pytest.approx([(s + 1) / 10 for s in range(10)]), name  # linear warmup
        assert curve[10] == pytest.approx(1.0), name
    assert rates["constant"][10:] == [1.0] * 110
    for name in ("cosine", "linear", "wsd"):
        assert rates[name][110] == pytest.approx(0.1) and rates[name][119] == pytest.approx(0.1), name
        assert all(a >= b for a, b in zip(rates[name][10:], rates[name][11:])), name  # never rises after warmup
    assert rates["linear"][60] == pytest.approx(0.55)  # half-way down, a straight line
    assert rates["cosine"][60] == pytest.approx(0.55) and rates["cosine"][35] > 0.55 + 0.45 / 2
    # wsd: the full rate up to the last 20% of the 110 steps (step 88), then a straight line down
    assert rates["wsd"][10:88] == [1.0] * 78 and rates["wsd"][99] == pytest.approx(0.55)
    assert rates["wsd"][109] == pytest.approx(0.1 + 0.9 / 22)  # the last update: one step before the minimum
    short = lr_lambda(2, 10, 0.1, "wsd", 0.01)  # a share of the steps under one step still decays over one
    assert [short(s) for s in (8, 9, 10)] == [1.0, 1.0, pytest.approx(0.1)]
    # a decay share longer than what follows the warmup decays from the warmup's end, never before it
    late = lr_lambda(10, 20, 0.1, "wsd", 0.9)
    assert late(9) == pytest.approx(1.0) and late(10) == pytest.approx(1.0) and late(15) == pytest.approx(0.55)
    assert late(20) == pytest.approx(0.1)


def test_a_run_follows_the_configured_schedule(tmp_path, corpus_file, data_cache):
    from model.lightning_module import lr_lambda

    train(compose_train(TINY + ["attention=swa", "attention.window=8", "trainer.max_steps=10", "optim.schedule=wsd",
                                "optim.decay_fraction=0.5", "trainer.val_every_n_steps=10"], tmp_path, corpus_file,
                        data_cache))
    logged = read_run_metrics(tmp_path / "metrics.csv")["train/lr"]
    expected = lr_lambda(2, 10, 0.1, "wsd", 0.5)
    assert sorted(logged) == list(range(10))
    assert all(logged[step] == pytest.approx(3e-3 * expected(step)) for step in logged)
    assert logged[4] == pytest.approx(3e-3) and logged[9] < 3e-3 * 0.3


def test_a_resumed_run_continues_its_wandb_run_and_a_fresh_one_starts_another(tmp_path, corpus_file, data_cache):
    common = TINY + ["attention=swa", "attention.window=8", "logger=wandb", "logger.wandb.mode=offline",
                     "optim.schedule_steps=4", "trainer.checkpoint_every_n_steps=2", "trainer.val_every_n_steps=2"]
    run = tmp_path / "run"

    def wandb_ids():
        return sorted(p.name.split("-")[3] for p in (run / "wandb").glob("offline-run-*"))

    train(compose_train(common + ["trainer.max_steps=2"], run, corpus_file, data_cache))
    first = (run / "wandb_run_id.txt").read_text().strip()
    train(compose_train(common + ["trainer.max_steps=4", "resume=auto"], run, corpus_file, data_cache))
    assert wandb_ids() == [first, first]
    # as after a hard kill: a checkpoint older than the steps logged would log steps 2-3 twice into one W&B run
    train(compose_train(common + ["trainer.max_steps=4", f"ckpt_path={run / 'checkpoints' / 'step0000002.ckpt'}"],
                        run, corpus_file, data_cache))
    again = (run / "wandb_run_id.txt").read_text().strip()
    assert again != first and wandb_ids() == sorted([first, first, again])
    train(compose_train(common + ["trainer.max_steps=2"], run, corpus_file, data_cache))  # a fresh run, same folder
    second = (run / "wandb_run_id.txt").read_text().strip()
    assert second not in (first, again) and wandb_ids() == sorted([first, first, again, second])
    assert (run / "previous-1" / "wandb_run_id.txt").read_text().strip() == again


def test_a_restart_from_an_earlier_checkpoint_replaces_the_abandoned_attempts_files(tmp_path, corpus_file,
                                                                                    data_cache):
    """Lightning's version counter wrote last-v1.ckpt and step0000004-v1.ckpt beside the abandoned attempt's files,
    and sample.py, evaluate.py, eval.after_train and tools.compare all read the abandoned last.ckpt."""
    from model.checkpoint import find_checkpoint, load_checkpoint
    from tools.runs import read_evals

    common = TINY + ["attention=sa", "attention.window=8", "optim.schedule_steps=4", "trainer.max_steps=4",
                     "trainer.checkpoint_every_n_steps=2", "trainer.val_every_n_steps=4"]
    run = tmp_path / "run"
    train(compose_train(common, run, corpus_file, data_cache))
    # the abandoned attempt's last.ckpt scored: the restart ends at the same step, with other weights
    scored = load_checkpoint(run).identity()
    assert scored["checkpoint_attempt"] and scored["checkpoint_step"] == 4
    (run / "eval" / "abandoned").mkdir(parents=True)
    (run / "eval" / "abandoned" / "results.json").write_text(json.dumps(
        {"checkpoint": str(run / "checkpoints" / "last.ckpt"), **scored,
         "results": [{"task": "probe_needle", "metric": "acc", "value": 0.5}]}))
    assert read_evals(run, steps=4) == {"probe_needle/acc": 0.5}
    with pytest.warns(UserWarning, match="optim.lr"):
        train(compose_train(common + ["optim.lr=1e-3", f"ckpt_path={run / 'checkpoints' / 'step0000002.ckpt'}"],
                            run, corpus_file, data_cache))
    assert sorted(p.name for p in (run / "checkpoints").glob("*.ckpt")) == [
        "last.ckpt", "step0000002.ckpt", "step0000004.ckpt"]
    for name in ("last.ckpt", "step0000004.ckpt"):
        saved = torch.load(run / "checkpoints" / name, weights_only=True, map_location="cpu")
        assert saved["optimizer_states"][0]["param_groups"][0]["initial_lr"] == 1e-3, name  # the restart's
    assert find_checkpoint(run) == run / "checkpoints" / "last.ckpt"
    assert load_checkpoint(run).attempt != scored["checkpoint_attempt"]
    assert read_evals(run, steps=4) == {}  # the step and the name are the same; the attempt is not


def test_older_step_checkpoints_shrink_to_their_weights(tmp_path, corpus_file, data_cache):
    from model.checkpoint import load_checkpoint

    common = TINY + ["attention=sa", "attention.window=8", "trainer.max_steps=7", "trainer.checkpoint_every_n_steps=2",
                     "trainer.val_every_n_steps=7"]
    train(compose_train(common + ["trainer.keep_checkpoints=2"], tmp_path / "kept", corpus_file, data_cache))
    ckpts = tmp_path / "kept" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["last.ckpt", "step0000006.ckpt", "step0000007.ckpt"]
    assert sorted(p.name for p in (ckpts / "weights").iterdir()) == ["step0000002.pt", "step0000004.pt"]
    slim = torch.load(ckpts / "weights" / "step0000004.pt", weights_only=True)
    assert "optimizer_states" not in slim and slim["global_step"] == 4
    # the same weights as the whole checkpoint of an identical run that keeps every one
    train(compose_train(common, tmp_path / "all", corpus_file, data_cache))
    whole = load_checkpoint(tmp_path / "all" / "checkpoints" / "step0000004.ckpt").model.state_dict()
    loaded = load_checkpoint(ckpts / "weights" / "step0000004.pt")
    assert loaded.step == 4 and all(torch.equal(whole[k], v) for k, v in loaded.model.state_dict().items())
    assert len(list((tmp_path / "all" / "checkpoints").glob("step*.ckpt"))) == 4
    train(compose_train(common + ["trainer.keep_checkpoints=1", "trainer.keep_weights=false", "trainer.max_steps=9",
                                  "resume=auto"], tmp_path / "kept", corpus_file, data_cache))
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["last.ckpt", "step0000009.ckpt"]
    assert sorted(p.name for p in (ckpts / "weights").iterdir()) == ["step0000002.pt", "step0000004.pt"]
    # a fresh run in the folder moves the weights aside with the rest of the earlier run
    train(compose_train(common + ["trainer.max_steps=2"], tmp_path / "kept", corpus_file, data_cache))
    assert not (ckpts / "weights").exists()
    assert sorted(p.name for p in (tmp_path / "kept" / "previous-1" / "checkpoints" / "weights").iterdir()) == [
        "step0000002.pt", "step0000004.pt"]


def test_pruning_keeps_the_newest_version_of_a_step(tmp_path):
    from model.checkpoint import prune_step_checkpoints

    from model.checkpoint import TRAINING_STATE

    training_state = {key: [1] for key in TRAINING_STATE}  # optimizer, schedule, loops, callbacks
    assert set(TRAINING_STATE) == {"optimizer_states", "lr_schedulers", "loops", "callbacks"}
    for name, step in (("step0000004.ckpt", 4), ("step0000004-v1.ckpt", 4), ("step0000002.ckpt", 2)):
        torch.save({"global_step": step, "state_dict": {}, **training_state, "name": name}, tmp_path / name)
    assert prune_step_checkpoints(tmp_path, keep=5) == [] and len(list(tmp_path.glob("*.ckpt"))) == 3  # fewer: none
    pruned = prune_step_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in pruned) == ["step0000002.ckpt", "step0000004.ckpt"]
    assert (tmp_path / "step0000004-v1.ckpt").is_file()
    slim = torch.load(tmp_path / "weights" / "step0000004.pt", weights_only=True)
    assert slim == {"global_step": 4, "state_dict": {}, "name": "step0000004.ckpt"}  # no training state


def test_the_stream_position_counts_ranks_accumulation_and_what_an_earlier_start_skipped():
    from model.checkpoint import stream_position

    ckpt = {"global_step": 5, "layout": {"world_size": 2, "accumulate_grad_batches": 3},
            "hyper_parameters": {"data": {"batch_size": 4}, "init_from": {"samples_skipped": 7}}}
    assert stream_position(ckpt) == 5 * 2 * 3 * 4 + 7
    assert stream_position({**ckpt, "layout": None}) is None  # an older checkpoint: not known


def test_init_from_starts_a_new_run_from_another_runs_weights(tmp_path, corpus_file, data_cache, capsys):
    from model.config import ConfigError

    common = TINY + ["attention.window=8", "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2"]
    source = tmp_path / "source"
    first = train(compose_train(common + ["attention=sa", "trainer.max_steps=4"], source, corpus_file, data_cache))
    # the same attention: the new run's validation before training scores the source's final weights
    same = train(compose_train(common + ["attention=sa", "trainer.max_steps=2", f"init_from={source}"],
                               tmp_path / "same", corpus_file, data_cache))
    assert same["val/loss_at_start"] == pytest.approx(first["val/loss"], abs=1e-6)
    rates = read_run_metrics(tmp_path / "same" / "metrics.csv")["train/lr"]
    assert sorted(rates) == [0, 1] and rates[0] == pytest.approx(3e-3 / 2)  # step 0, the schedule's warmup anew
    saved = torch.load(tmp_path / "same" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 2 and saved["hyper_parameters"]["init_from"]["step"] == 4
    # on the source's stream its data starts after the source's 4 steps of 4 windows, instead of replaying them
    assert saved["hyper_parameters"]["init_from"]["samples_skipped"] == 4 * 4
    assert "the data stream starts after the 16 windows the checkpoint trained on" in capsys.readouterr().err
    # a resume may switch to independent draws, which have no place in a stream to continue from (it crashed in fit)
    switch = ["trainer.max_steps=3", "resume=auto", "data.sampling=random", "optim.schedule_steps=2"]
    train(compose_train(common + ["attention=sa", f"init_from={source}"] + switch, tmp_path / "same", corpus_file,
                        data_cache), overrides=switch)  # as on the command line: a resume keeps its sampling else
    assert sorted(read_run_metrics(tmp_path / "same" / "metrics.csv")["train/loss"]) == [0, 1, 2]
    train(compose_train(common + ["attention=sa", "trainer.max_steps=1", "seed=5", f"init_from={source}"],
                        tmp_path / "seed5", corpus_file, data_cache))
    assert "starts at its beginning (the checkpoint's seed 0 is not this run's)" in capsys.readouterr().err
    assert torch.load(tmp_path / "seed5" / "checkpoints" / "last.ckpt",
                      weights_only=True)["hyper_parameters"]["init_from"]["samples_skipped"] == 0  # another stream
    # SA weights start a gated SA+SWA model: its gates open at 0.5; resumed, the run continues from its own checkpoint
    gated = tmp_path / "gated"
    train(compose_train(common + ["attention=gated_sa_swa", "trainer.max_steps=2", f"init_from={source}"], gated,
                        corpus_file, data_cache))
    assert "the gates start at 0.5" in capsys.readouterr().err
    assert read_run_metrics(gated / "metrics.csv")["gates/sa/layer00"][0] == 0.5
    train(compose_train(common + ["attention=gated_sa_swa", "trainer.max_steps=4", f"init_from={source}",
                                  "resume=auto", "optim.schedule_steps=2"], gated, corpus_file, data_cache))
    assert sorted(read_run_metrics(gated / "metrics.csv")["train/loss"]) == [0, 1, 2, 3]
    resumed = torch.load(gated / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 4 and resumed["hyper_parameters"]["init_from"]["step"] == 4  # still recorded
    with pytest.raises(ConfigError, match="model.d_model"):
        train(compose_train(common + ["attention=sa", "model.d_model=32", f"init_from={source}"], tmp_path / "bad",
                            corpus_file, data_cache))


def test_activation_checkpointing_keeps_the_gradients_and_saves_less():
    """Recomputed in the backward with the same pi: the same gradients, and only each block's input kept."""
    from model.config import AttentionConfig, ModelConfig
    from model.decoder import Decoder

    grads, saved = {}, {}
    tokens = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    for recompute in (False, True):
        torch.manual_seed(0)  # the same initial weights
        model = Decoder(ModelConfig(vocab_size=64, n_layers=3, d_model=32, n_heads=2, max_seq_len=48),
                        AttentionConfig(kind="gated_sa_swa", window=8, backend="torch"), seed=1).train()
        model.checkpoint_activations = recompute
        model.sampler.step = 7
        nbytes = []

        def pack(t, nbytes=nbytes):
            nbytes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:])
        loss.backward()
        grads[recompute] = {n: p.grad for n, p in model.named_parameters()}
        saved[recompute] = sum(nbytes)
    for name, grad in grads[False].items():
        assert torch.allclose(grads[True][name], grad, atol=1e-6), name
    assert saved[True] < saved[False] / 2, saved


def test_a_run_with_activation_checkpointing_logs_the_same_losses(tmp_path, corpus_file, data_cache):
    common = TINY + ["attention=sa", "attention.window=8", "trainer.max_steps=3", "trainer.val_every_n_steps=3"]
    plain = train(compose_train(common, tmp_path / "plain", corpus_file, data_cache))
    recomputed = train(compose_train(common + ["trainer.activation_checkpointing=true"], tmp_path / "ckpt",
                                     corpus_file, data_cache))
    assert recomputed["val/loss"] == pytest.approx(plain["val/loss"], abs=1e-5)
    losses = [read_run_metrics(tmp_path / name / "metrics.csv")["train/loss"] for name in ("plain", "ckpt")]
    assert all(losses[1][step] == pytest.approx(value, abs=1e-5) for step, value in losses[0].items())


def test_prepare_only_prepares_the_data_and_trains_nothing(tmp_path, corpus_file):
    cache = tmp_path / "cache"
    assert train(compose_train(TINY + ["prepare_only=true"], tmp_path / "run", corpus_file, cache)) == {}
    assert list(cache.glob("files-*/meta.json")) and not (tmp_path / "run" / "checkpoints").exists()


def test_resume_auto_in_a_folder_without_a_run_says_so_before_the_data_is_prepared(tmp_path, corpus_file, capsys):
    cache = tmp_path / "cache"
    train(compose_train(TINY + ["prepare_only=true", "resume=auto"], tmp_path / "mistyped", corpus_file, cache))
    err = capsys.readouterr().err
    said = err.index("starting from step 0 a new run: no run was started in this folder before")
    assert said < err.index("data:")  # before preparing (a mistyped run dir should not cost a tokenization)


def test_a_window_that_covers_the_context_is_said_to_be_full_attention(tmp_path, corpus_file, data_cache, capsys):
    cfg = compose_train(TINY + ["attention=sa", "trainer.max_steps=1"], tmp_path / "run",
                        corpus_file, data_cache)
    n = int(cfg.data.seq_len)
    cfg.attention.window = 2 * n - 1  # SA's symmetric band spans every slot of every query from here on
    train(cfg)
    err = capsys.readouterr().err
    assert f"attention.window={2 * n - 1} at data.seq_len={n}: every query sees every earlier token" in err
    assert "attention=sa window=" in err and "full causal attention in effect" in err


def test_a_resume_is_not_warned_about_its_own_checkpoint_folder(tmp_path, corpus_file, data_cache, recwarn):
    common = TINY + ["trainer.checkpoint_every_n_steps=1"]
    train(compose_train(common + ["trainer.max_steps=1"], tmp_path / "run", corpus_file, data_cache))
    recwarn.clear()
    train(compose_train(common + ["trainer.max_steps=2", "resume=auto"], tmp_path / "run", corpus_file, data_cache))
    assert not [w for w in recwarn if "exists and is not empty" in str(w.message)]


def test_a_damaged_last_checkpoint_names_the_one_before_it(tmp_path, corpus_file, data_cache):
    """A last.ckpt cut short (a full disk, a killed copy) stopped resume=auto with torch's zip-reader traceback."""
    from model.checkpoint import CheckpointError

    common = TINY + ["trainer.checkpoint_every_n_steps=1"]
    train(compose_train(common + ["trainer.max_steps=2"], tmp_path / "run", corpus_file, data_cache))
    ckpts = tmp_path / "run" / "checkpoints"
    last = ckpts / "last.ckpt"
    last.write_bytes(last.read_bytes()[:4000])
    os.utime(last)  # the newest, as a save that was cut would be
    [before] = [p for p in sorted(ckpts.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if p != last][-1:]
    with pytest.raises(CheckpointError, match=f"no torch.save archive.*ckpt_path={before}"):
        train(compose_train(common + ["trainer.max_steps=3", "resume=auto"], tmp_path / "run", corpus_file,
                            data_cache))


def test_the_resume_check_compares_models_as_built():
    from model.config import ConfigError
    from model.lightning_module import _check_resumed_config

    def hp(**model):
        return {"model": {"n_heads": 4, "d_model": 64, **model}, "attention": {"kind": "sa"}, "max_steps": 4}

    _check_resumed_config(hp(n_kv_heads=None, ffn_hidden=None), hp(n_kv_heads=4, ffn_hidden=256))  # the same shapes
    _check_resumed_config({"max_steps": 4}, hp())  # an older checkpoint without the groups
    with pytest.raises(ConfigError, match="model.n_kv_heads"):
        _check_resumed_config(hp(n_kv_heads=None), hp(n_kv_heads=2))
    with pytest.raises(ConfigError, match="attention.kind.*gates"):
        _check_resumed_config(hp(), {**hp(), "attention": {"kind": "gated_sa_swa"}})


def test_data_val_split_is_the_default_of_older_checkpoints_and_part_of_the_stream(recwarn):
    """A checkpoint from before data.val_split split by index: its resume is no config change; an init_from run with
    the other split trains on other documents, so it does not skip the source's windows."""
    from model.lightning_module import _check_resumed_config
    from tools.resume import STREAM_KEYS, continued_stream

    data = {"source": {"kind": "embedded"}, "val_fraction": 0.05, "max_tokens": None, "seq_len": 64,
            "window_start": "any", "sampling": "shuffled"}
    _check_resumed_config({"data": data}, {"data": {**data, "val_split": "index"}})
    assert not [w for w in recwarn if "val_split" in str(w.message)]
    assert "val_split" in STREAM_KEYS
    source = {"samples": 5000, "seed": 0, "data": data}
    assert continued_stream({"seed": 0, "data": {**data, "val_split": "index"}}, source) == (5000, None)
    assert continued_stream({"seed": 0, "data": {**data, "val_split": "content"}}, source) == (
        0, "data.val_split differs")


def test_what_is_moved_aside_and_what_counts_as_this_runs_checkpoint(tmp_path):
    """Checkpoint files move, not their folder (a link to other storage stays where ModelCheckpoint writes); a
    checkpoint anywhere under checkpoints/ is the run's own; an empty checkpoints/ is no earlier run."""
    from tools.resume import own_checkpoint, set_aside_earlier_run

    run, storage = tmp_path / "run", tmp_path / "scratch"
    storage.mkdir()
    run.mkdir()
    (run / "checkpoints").symlink_to(storage)
    assert set_aside_earlier_run(run, run / "checkpoints") is None  # nothing there yet
    (storage / "last.ckpt").write_text("old")
    (run / "metrics.csv").write_text("step\n0\n")
    aside = set_aside_earlier_run(run, run / "checkpoints")
    assert (aside / "checkpoints" / "last.ckpt").read_text() == "old" and (aside / "metrics.csv").is_file()
    assert (run / "checkpoints").is_symlink() and not list(storage.iterdir())
    (storage / "keep").mkdir()
    assert own_checkpoint(str(run / "checkpoints" / "keep" / "x.ckpt"), run / "checkpoints")
    assert own_checkpoint(str(storage / "last.ckpt"), run / "checkpoints")  # through the link
    assert not own_checkpoint(str(aside / "checkpoints" / "last.ckpt"), run / "checkpoints")
    assert not own_checkpoint(None, run / "checkpoints")


def test_metrics_csv_is_appended_on_resume(tmp_path):
    from model.csv_log import RunCSVLogger

    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train/loss\n0,0,5.0\n0,1,4.5\n")
    resumed = RunCSVLogger(tmp_path)
    resumed.log_metrics({"train/loss": 4.25}, step=2)
    resumed.save()
    resumed.log_metrics({"val/loss": 4.0}, step=2)  # a column the first attempt never logged
    resumed.save()
    rows = list(csv.DictReader(path.open()))
    assert [(r["step"], r["train/loss"], r["val/loss"]) for r in rows] == [
        ("0", "5.0", ""), ("1", "4.5", ""), ("2", "4.25", ""), ("2", "", "4.0")]
    assert rows[0]["epoch"] == "0"

    # an attempt killed mid-write leaves a torn last row; a header out of sorted order (Lightning sorts the columns it
    # writes) would shift appended values into other columns
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "metrics.csv").write_text("train/loss,step,epoch\n4.5,1,0\n4.2,2")
    resumed = RunCSVLogger(torn)
    resumed.log_metrics({"train/loss": 4.0}, step=2)
    resumed.save()
    rows = list(csv.DictReader((torn / "metrics.csv").open()))
    assert [(r["step"], r["train/loss"], r["epoch"]) for r in rows] == [("1", "4.5", "0"), ("2", "4.0", "")]
    assert read_run_metrics(torn / "metrics.csv")["train/loss"] == {1: 4.5, 2: 4.0}
    fresh = tmp_path / "fresh"
    logger = RunCSVLogger(fresh)
    logger.log_metrics({"train/loss": 4.0, "epoch": 1}, step=3)  # Lightning's loop epoch, not a pass over the data
    logger.save()
    assert (fresh / "metrics.csv").read_text().splitlines()[0] == "step,train/loss"


def test_an_intact_metrics_file_with_unsorted_columns_is_appended_to_the_right_columns(tmp_path):
    """Lightning's writer puts each row's values in sorted column order under the header it finds: a whole file (no
    torn row) whose header is out of that order must be rewritten sorted before a resume appends to it, else the
    appended values land under other columns (the step read as the loss)."""
    from model.csv_log import RunCSVLogger

    path = tmp_path / "metrics.csv"
    path.write_text("train/loss,step\n5.0,0\n4.5,1\n")
    resumed = RunCSVLogger(tmp_path)
    resumed.log_metrics({"train/loss": 4.25}, step=2)
    resumed.save()
    rows = list(csv.DictReader(path.open()))
    assert [(r["step"], r["train/loss"]) for r in rows] == [("0", "5.0"), ("1", "4.5"), ("2", "4.25")]


def test_a_new_metrics_column_rewrites_the_file_atomically(tmp_path, monkeypatch):
    """A new column rewrites every row (the eval/* scores at the end of each run): a failure mid-way (a full disk, a
    kill) must leave the history as it was; Lightning's own rewrite truncated the file first."""
    from model.csv_log import RunCSVLogger

    path = tmp_path / "metrics.csv"
    path.write_text("step,train/loss\n0,5.0\n1,4.5\n")
    logger = RunCSVLogger(tmp_path)
    logger.log_metrics({"eval/wikitext_ppl": 30.0}, step=2)

    def disk_full(self, rows):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(csv.DictWriter, "writerows", disk_full)
    with pytest.raises(OSError):
        logger.save()
    assert path.read_text() == "step,train/loss\n0,5.0\n1,4.5\n"
    monkeypatch.undo()
    logger.save()
    rows = list(csv.DictReader(path.open()))
    assert [(r["step"], r["train/loss"], r["eval/wikitext_ppl"]) for r in rows] == [
        ("0", "5.0", ""), ("1", "4.5", ""), ("2", "", "30.0")]


def test_final_weights_are_validated_when_the_last_step_is_not_a_validation_step(tmp_path, corpus_file, data_cache):
    cfg = compose_train(TINY + ["attention=sa", "attention.window=8", "trainer.max_steps=3",
                                "trainer.val_every_n_steps=2"], tmp_path, corpus_file, data_cache)
    metrics = read_metrics_after(cfg)
    # Before training; the scheduled one after 2 updates; and the final weights, validated after fit. Each is
    # labelled with the updates its weights have had. Without the last one the run's final val loss would describe
    # the weights of step 2.
    assert sorted(metrics["val/loss"]) == [0, 2, 3]


def read_metrics_after(cfg):
    train(cfg)
    return read_metrics(Path(cfg.paths.run_dir))


def _module_with_trainer():
    import lightning as L

    module = LitDecoder(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                        attention=dict(kind="sa", window=4), optim={}, max_steps=10)
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    module.logged = {}
    module.log = lambda name, value, **kw: module.logged.__setitem__(name, float(value))  # what Lightning records
    return module, torch.optim.SGD(module.parameters(), lr=0.1)


def test_non_finite_loss_stops_with_the_step_before_the_update():
    """Checked once per optimizer step: a micro-batch's forward no longer waits for the device."""
    module, optimizer = _module_with_trainer()
    with torch.no_grad():
        module.model.embed.weight.fill_(float("nan"))
    loss = module.training_step(torch.randint(0, 32, (2, 9)), 0)
    assert not torch.isfinite(loss)  # no stop yet: the check would have waited for the forward
    with pytest.raises(NonFiniteLossError, match="non-finite at step 0"):
        module.on_before_optimizer_step(optimizer)


def test_a_resave_without_training_keeps_the_checkpoints_attempt():
    """A resume with nothing left to train re-saves the same weights: scores of the loaded file still hold."""
    module = LitDecoder(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                        attention=dict(kind="sa", window=4), optim={}, max_steps=10)
    module._attempt = "this-run"
    module.on_load_checkpoint({"attempt": "loaded", "global_step": 4, "hyper_parameters": dict(module.hparams)})
    for step, attempt in ((4, "loaded"), (5, "this-run")):
        saved = {"global_step": step}
        module.on_save_checkpoint(saved)
        assert saved["attempt"] == attempt, step
    module.on_load_checkpoint({"global_step": 4, "hyper_parameters": dict(module.hparams)})  # older: none recorded
    saved = {"global_step": 4}
    module.on_save_checkpoint(saved)
    assert saved["attempt"] == "this-run"


def test_the_progress_bar_of_a_run_counted_in_steps_names_no_last_epoch():
    import lightning as L

    from model.lightning_module import StepProgressBar

    bar = StepProgressBar()
    bar._trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, max_epochs=-1, logger=False,
                             enable_checkpointing=False, callbacks=[bar])
    assert bar._get_train_description(0).strip() == "Epoch 0"  # Lightning's own: "Epoch 0/-2"
    bar._trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                             callbacks=[bar])
    assert bar._get_train_description(1).strip() == "Epoch 1/2"


def test_the_progress_bar_counts_micro_batches_of_the_steps_left():
    """Under accumulation the bar's total is micro-batches: Lightning's (steps left) read 60/30 after a 30-step run."""
    from types import SimpleNamespace

    from model.lightning_module import StepProgressBar

    bar = StepProgressBar()
    progress = SimpleNamespace(ready=0)  # the micro-batches of this epoch run so far (in this process or before)
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=progress)))
    bar._trainer = SimpleNamespace(max_epochs=-1, max_steps=30, global_step=4, accumulate_grad_batches=2,
                                   num_training_batches=float("inf"), fit_loop=loop)
    assert bar.total_train_batches == 52
    progress.ready = 8  # resumed at step 4: the bar counts on from batch 8
    assert bar.total_train_batches == 60
    bar._trainer.num_training_batches = 40  # an epoch shorter than what is left
    assert bar.total_train_batches == 40


def test_a_real_fit_stops_on_a_non_finite_loss_without_updating_the_weights():
    import lightning as L

    module = LitDecoder(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                        attention=dict(kind="sa", window=4), max_steps=10,
                        optim=dict(lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, warmup_steps=0,
                                   min_lr_ratio=0.1))
    with torch.no_grad():
        module.model.embed.weight[3].fill_(float("nan"))  # only batches holding token 3 go non-finite
    before = {k: v.clone() for k, v in module.state_dict().items()}
    batches = [torch.randint(4, 32, (2, 9)), torch.full((2, 9), 3)]  # the second micro-batch of step 0
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, max_steps=10,
                        accumulate_grad_batches=2, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(NonFiniteLossError, match="non-finite at step 0"):
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == 0
    after = module.state_dict()
    assert all(torch.equal(before[k].nan_to_num(), after[k].nan_to_num()) for k in before)  # no update applied


def test_a_non_finite_loss_on_another_rank_stops_this_one_too(monkeypatch):
    """Every rank raises at the same step: a rank left running would wait for the others in the next all-reduce.
    The step's loss is summed over the ranks, so another rank's NaN reaches this one."""
    module, optimizer = _module_with_trainer()
    strategy = module.trainer.strategy
    monkeypatch.setattr(type(strategy), "world_size", property(lambda self: 2), raising=False)  # trainer.world_size
    reduced = []
    monkeypatch.setattr(strategy, "reduce", lambda t, reduce_op: reduced.append(t.clone()) or
                        t + torch.tensor([float("nan"), 18.0]))  # the other rank: a NaN loss over 18 targets
    loss = module.training_step(torch.randint(0, 32, (2, 9)), 0)
    assert torch.isfinite(loss)  # this rank's own loss was finite
    with pytest.raises(NonFiniteLossError, match="non-finite at step 0"):
        module.on_before_optimizer_step(optimizer)
    assert len(reduced) == 1 and reduced[0][1] == 16  # this rank's 2 x 8 targets went into the one reduce
    finite = module.training_step(torch.randint(0, 32, (2, 9)), 0)  # the sums were reset: this step logs its loss
    monkeypatch.setattr(strategy, "reduce", lambda t, reduce_op: t * 2)  # the other rank: the same loss and count
    module.logged.clear()
    module.on_before_optimizer_step(optimizer)
    assert module.logged == {"train/lr": 0.1, "train/loss": pytest.approx(float(finite))}


def test_gradients_are_clipped_to_optim_grad_clip_and_the_norm_before_is_logged():
    """Loss curves cannot see clipping (AdamW hardly reacts to a rescaled gradient): the norm itself is checked."""
    import lightning as L

    torch.manual_seed(0)
    module = LitDecoder(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                        attention=dict(kind="sa", window=4), max_steps=4, optim=dict(grad_clip=0.05))
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    module.trainer.strategy.model = module
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))  # what Lightning would record

    def grad_norm():
        return float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters() if p.grad is not None]))

    module._loss(torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1)))[0].backward()
    before = grad_norm()
    assert before > 0.5  # the clip engages
    module.configure_gradient_clipping(None)
    assert logged["train/grad_norm"] == pytest.approx(before, rel=1e-5)
    assert grad_norm() == pytest.approx(0.05, rel=1e-3)
    next(module.parameters()).grad[0] = float("inf")  # a finite loss, an overflowed gradient: no update
    with pytest.raises(NonFiniteLossError, match="gradient became non-finite at step 0"):
        module.configure_gradient_clipping(None)


def test_training_uses_the_fused_adamw_and_resumes_an_unfused_ones_state():
    """configure_optimizers makes torch's fused AdamW on the CPU, which steps like the unfused one; the state of the
    unfused AdamW that checkpoints before 2026-12-02 hold loads into it and steps on as the unfused one would."""
    import copy

    optim = dict(lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, warmup_steps=1, min_lr_ratio=0.1)

    def module():
        torch.manual_seed(0)
        return LitDecoder(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                          attention=dict(kind="sa", window=4), optim=optim, max_steps=10)

    def unfused(mod):
        return torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]}
                                  for g in mod.configure_optimizers()["optimizer"].param_groups],
                                 lr=optim["lr"], betas=tuple(optim["betas"]), eps=optim["eps"])

    def steps(mod, opt, count):
        for i in range(count):
            mod._loss(torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(i)))[0].backward()
            opt.step()
            opt.zero_grad()

    fused_module, old_module = module(), module()
    fused = fused_module.configure_optimizers()["optimizer"]
    assert all(group["fused"] for group in fused.param_groups)
    old = unfused(old_module)
    steps(fused_module, fused, 4)
    steps(old_module, old, 4)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fused_module.parameters(), old_module.parameters()))
    resumed_module, reference_module = module(), module()
    resumed, reference = resumed_module.configure_optimizers()["optimizer"], unfused(reference_module)
    for mod, opt in ((resumed_module, resumed), (reference_module, reference)):
        mod.load_state_dict(old_module.state_dict())
        opt.load_state_dict(copy.deepcopy(old.state_dict()))  # as from a checkpoint: no moments shared
        steps(mod, opt, 2)
    assert not any(group["fused"] for group in resumed.param_groups)
    assert all(torch.equal(a, b) for a, b in zip(resumed_module.parameters(), reference_module.parameters()))


def test_a_resume_that_stays_unfused_says_so(monkeypatch):
    """The unfused AdamW a pre-2026-12-02 checkpoint brings is noted in the log at the start of training; a fused
    optimizer, and one left unfused for a GradScaler, are not."""
    import lightning as L
    import model.lightning_module as lm

    notes = []
    monkeypatch.setattr(lm, "rank_zero_info", notes.append)
    module = LitDecoder(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                        attention=dict(kind="sa", window=4),
                        optim=dict(lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, warmup_steps=1,
                                   min_lr_ratio=0.1), max_steps=10)
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    fused = module.configure_optimizers()["optimizer"]
    unfused = torch.optim.AdamW([{"params": g["params"]} for g in fused.param_groups])  # as checkpoints made them
    for opt, expected in ((fused, 0), (unfused, 1)):
        module.trainer.strategy.optimizers = [opt]
        module._note_unfused_resume()
        assert len(notes) == expected
    assert "unfused" in notes[0] and "bench.optimizer" in notes[0]
    monkeypatch.setattr(module.trainer.precision_plugin, "scaler", torch.amp.GradScaler("cpu"), raising=False)
    module._note_unfused_resume()
    assert len(notes) == 1


def test_no_fused_adamw_under_a_grad_scaler():
    """precision=16-mixed: a fused AdamW unscales inside its step, so Lightning would leave the gradients scaled
    (x65536) for configure_gradient_clipping, which would clip and log the scaled norm."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    module = LitDecoder(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                        attention=dict(kind="sa", window=4),
                        optim=dict(lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, warmup_steps=1,
                                   min_lr_ratio=0.1), max_steps=10)
    for plugins, fused in (([MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))], None),
                           ([], True)):
        module.trainer = L.Trainer(accelerator="cpu", devices=1, plugins=plugins, logger=False,
                                   enable_checkpointing=False)
        opt = module.configure_optimizers()["optimizer"]
        assert [group["fused"] for group in opt.param_groups] == [fused, fused]
        assert bool(getattr(opt, "_step_supports_amp_scaling", False)) == bool(fused)


def test_weight_decay_groups_survive_fsdp_flattening():
    """FSDP hands configure_optimizers flat 1-D shards under wrapped names: the groups must not depend on shapes."""
    module = LitDecoder(model=dict(vocab_size=32, n_layers=2, d_model=16, n_heads=2, max_seq_len=16),
                        attention=dict(kind="gated_sa_swa", window=4),
                        optim=dict(lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, warmup_steps=1,
                                   min_lr_ratio=0.1), max_steps=10)
    expected = sum(p.numel() for n, p in module.model.named_parameters() if p.dim() >= 2 and "embed" not in n)

    class Wrapped(torch.nn.Module):  # the attribute name FSDP gives the module it wraps
        def __init__(self, inner):
            super().__init__()
            self._fsdp_wrapped_module = inner

    module.model.blocks = torch.nn.ModuleList(Wrapped(b) for b in module.model.blocks)
    for p in module.model.parameters():
        p.data = p.data.reshape(-1)
    decay, no_decay = module.configure_optimizers()["optimizer"].param_groups
    assert decay["weight_decay"] == 0.1 and sum(p.numel() for p in decay["params"]) == expected > 0
    assert all(p.numel() <= 16 for p in no_decay["params"] if p is not module.model.embed.weight)  # norms, biases


def test_flops_per_token_counts_the_head_and_the_matmuls_that_run():
    """6 x (non-embedding parameters + the tied head's d x V) is what the linear layers run, by torch's FLOP counter
    (the fused attention kernel is counted apart: aten's counter takes it as dense); SWA with w >= n is full."""
    from torch.utils.flop_counter import FlopCounterMode

    def model(tie=True, **attention):
        return LitDecoder(model=dict(vocab_size=512, n_layers=2, d_model=64, n_heads=4, max_seq_len=32,
                                     tie_embeddings=tie), attention=attention, optim={}, max_steps=10).model

    tokens = torch.randint(0, 512, (2, 32))
    for tie in (True, False):  # an untied head is counted once, as the one matmul it is (the 360M preset's)
        swa = model(tie, kind="swa", window=32, backend="torch")
        with FlopCounterMode(display=False) as counter:
            swa(tokens).float().pow(2).mean().backward()
        linear = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
        attention = 12 * swa.cfg.n_layers * swa.cfg.d_model * (32 + 1) / 2  # a causal band of w = n keys
        assert (swa.flops_per_token(32) - attention) * tokens.numel() == pytest.approx(linear, rel=0.01), tie
    assert swa.flops_per_token(32) == pytest.approx(model(False, kind="full").flops_per_token(32))


@pytest.mark.parametrize("window", [1, 4, 9, 64, 200])
def test_flops_per_token_counts_the_keys_sa_lets_a_query_see(window):
    """MFU counts model FLOPs, as FlashAttention counts causal attention: SA was credited its whole band of w, of
    which a random order hides the later half (124.5 of 256 keys at n=2048). The count is checked against the
    reference mask, averaged over permutations."""
    from kernels import default_band
    from kernels.naive import band_mask

    n = 64
    cfg = dict(model=dict(vocab_size=512, n_layers=2, d_model=64, n_heads=4, max_seq_len=n), optim={}, max_steps=10)
    sa = LitDecoder(attention=dict(kind="sa", window=window), **cfg).model
    swa = LitDecoder(attention=dict(kind="swa", window=window), **cfg).model
    gated = LitDecoder(attention=dict(kind="gated_sa_swa", window=window), **cfg).model
    gen = torch.Generator().manual_seed(0)
    perms = torch.stack([torch.randperm(n, generator=gen) for _ in range(400)])
    seen = band_mask(perms, *default_band(window, permuted=True)).sum(-1).float().mean().item()
    causal = band_mask(torch.arange(n), *default_band(window, permuted=False)).sum(-1).float().mean().item()
    per_key = 12 * sa.cfg.n_layers * sa.cfg.d_model
    assert (sa.flops_per_token(n) - swa.flops_per_token(n)) / per_key == pytest.approx(seen - causal, abs=0.05)
    gates = 6 * (gated.num_parameters(non_embedding=True) - swa.num_parameters(non_embedding=True))
    assert (gated.flops_per_token(n) - gates - swa.flops_per_token(n)) / per_key == pytest.approx(seen, rel=0.01)


def test_each_micro_batch_of_an_accumulated_step_draws_its_own_permutations(tmp_path):
    import lightning as L

    class RecordSteps(L.Callback):
        def __init__(self):
            self.steps = []

        def on_before_backward(self, trainer, pl_module, loss):
            self.steps.append(pl_module.model.sampler.step)  # the seed of the permutations this forward drew

    module = LitDecoder(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                        attention=dict(kind="sa", window=4), max_steps=3,
                        optim=dict(lr=1e-3, weight_decay=0.0, betas=[0.9, 0.95], eps=1e-8, warmup_steps=1,
                                   min_lr_ratio=0.1))
    record = RecordSteps()
    trainer = L.Trainer(accelerator="cpu", max_steps=3, accumulate_grad_batches=2, logger=False, callbacks=[record],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    batches = torch.utils.data.DataLoader(torch.randint(0, 32, (6, 17)), batch_size=1, collate_fn=torch.stack)
    trainer.fit(module, train_dataloaders=batches)
    assert record.steps == [0, 1, 2, 3, 4, 5]


def _tiny_module(kind="swa", max_steps=8):
    return LitDecoder(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                      attention=dict(kind=kind, window=4), max_steps=max_steps,
                      optim=dict(lr=1e-3, weight_decay=0.0, betas=[0.9, 0.95], eps=1e-8, warmup_steps=1,
                                 min_lr_ratio=0.1))


def test_train_loss_is_the_mean_over_the_steps_micro_batches(tmp_path):
    """Logged from training_step, train/loss was the last micro-batch's only: 1/accumulation of the step's data."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    class RecordLosses(L.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            with torch.no_grad():  # SWA: no permutations, the same loss the step computes from these weights
                self.losses.append(float(pl_module._loss(batch)[0]))

    record = RecordLosses()
    trainer = L.Trainer(accelerator="cpu", max_steps=3, accumulate_grad_batches=3, callbacks=[record],
                        logger=CSVLogger(tmp_path, name="log"), log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    batches = torch.utils.data.DataLoader(torch.randint(0, 32, (9, 17)), batch_size=1, collate_fn=torch.stack)
    trainer.fit(_tiny_module(), train_dataloaders=batches)
    [path] = list((tmp_path / "log").rglob("metrics.csv"))
    logged = read_run_metrics(path)["train/loss"]
    assert sorted(logged) == [0, 1, 2]
    for step in range(3):
        assert logged[step] == pytest.approx(sum(record.losses[3 * step:3 * step + 3]) / 3, rel=1e-5), step


def test_tokens_per_s_leaves_out_checkpoint_saves(tmp_path):
    """ModelCheckpoint saves in its own on_train_batch_end, before the module measures the step: a slow save read
    as a slow step (~60 against ~5,500 tokens/s with a 0.5 s save)."""
    import time

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class SlowDisk(TorchCheckpointIO):
        def save_checkpoint(self, *args, **kwargs):
            time.sleep(0.5)
            super().save_checkpoint(*args, **kwargs)

    trainer = L.Trainer(accelerator="cpu", max_steps=8, plugins=[SlowDisk()], log_every_n_steps=1,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1,
                                                   save_last=True)],  # as train.py: two saves after the step
                        logger=CSVLogger(tmp_path, name="log"), enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    batches = torch.utils.data.DataLoader(torch.randint(0, 32, (8, 17)), batch_size=1, collate_fn=torch.stack)
    trainer.fit(_tiny_module(), train_dataloaders=batches)
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 3  # after steps 3 and 6 (rows 2 and 5), and last
    [path] = list((tmp_path / "log").rglob("metrics.csv"))
    rates = read_run_metrics(path)["train/tokens_per_s"]
    others = sorted(v for step, v in rates.items() if step not in (2, 5))
    median = others[len(others) // 2]
    assert min(rates[2], rates[5]) > median / 5, (rates, median)  # 0.5 s in a ~10 ms step would be ~50x slower


def test_tokens_per_s_is_the_rate_over_the_logging_interval(monkeypatch):
    """One micro-batch's rate is as noisy as the machine (a busy core read as a 5x slower step): the logged rate is
    the tokens of the interval's micro-batches over their time."""
    import lightning as L

    import model.lightning_module as lm

    module = _tiny_module()
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                               log_every_n_steps=2)
    logged = []
    module.log = lambda name, value, **kw: logged.append(float(value)) if name == "train/tokens_per_s" else None
    clock = iter([0.0, 1.0, 3.0, 3.5])
    monkeypatch.setattr(lm.time, "perf_counter", lambda: next(clock))
    batch = torch.randint(0, 32, (2, 17))  # 32 tokens
    for _ in range(4):
        module.on_train_batch_end(None, batch, 0)
    assert logged == [32 / 1.0, 64 / 3.0, 64 / 2.5]  # the first batch starts the clock; then the last two


def test_tokens_per_s_and_mfu_over_ranks_and_accumulation(monkeypatch):
    """Two ranks, two micro-batches per step: the rate counts every rank's tokens over the step's micro-batches, and
    MFU is one rank's share of the FLOPs over one device's peak (untested: world size and accumulation)."""
    import lightning as L

    import model.lightning_module as lm

    module = _tiny_module()
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                               log_every_n_steps=1, accumulate_grad_batches=2)
    monkeypatch.setattr(type(module.trainer), "world_size", property(lambda self: 2))
    module._peak = 1e12
    logged = {}
    module.log = lambda name, value, **kw: logged.setdefault(name, []).append(float(value))
    clock = iter([0.0, 1.0, 3.0, 3.5])
    monkeypatch.setattr(lm.time, "perf_counter", lambda: next(clock))
    batch = torch.randint(0, 32, (2, 17))  # 32 tokens a rank
    for _ in range(4):
        module.on_train_batch_end(None, batch, 0)
    rates = [64 / 1.0, 128 / 3.0, 128 / 2.5]  # a window of 2 micro-batches, each 2 ranks x 32 tokens
    assert logged["train/tokens_per_s"] == pytest.approx(rates)
    assert logged["train/mfu"] == pytest.approx([module.model.flops_per_token(16) * r / 2 / 1e12 for r in rates])


def test_mfu_counts_the_whole_model_under_fsdp():
    """Under FSDP a parameter outside the forward holds one rank's shard: a count taken then shrank MFU."""
    module = _tiny_module()
    expected = module.model.flops_per_token(16)
    for p in module.model.parameters():
        p.data = p.data.reshape(-1)[: max(1, p.numel() // 2)]  # what one of two ranks holds
    assert module._flops(16) == expected


def test_peak_flops_of_device_names():
    from model.lightning_module import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == peak_flops("NVIDIA A100-PCIE-40GB") == 312e12
    assert peak_flops("NVIDIA A100 80GB PCIe") == 312e12 and peak_flops("NVIDIA GeForce RTX 4090") == 165e12
    assert peak_flops("NVIDIA L40S") == 362e12 and peak_flops("NVIDIA L4") == 121e12
    assert peak_flops("NVIDIA H100 PCIe") is None and peak_flops("NVIDIA H100 NVL") is None
    assert peak_flops("Tesla T4") is None


@pytest.mark.parametrize("chunk", [0, 5])  # trainer.loss_chunk_tokens: 36 targets in chunks of 5
def test_loss_only_after_counts_just_the_following_tokens(chunk):
    torch.manual_seed(0)
    module = LitDecoder(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                        attention=dict(kind="sa", window=4), optim={}, max_steps=10)
    module.loss_chunk_tokens = chunk
    module.eval()  # the same permutations in every forward below
    batch = torch.randint(1, 32, (3, 13))
    batch[0, 2], batch[1, 5], batch[1, 11], batch[2, 12] = 0, 0, 0, 0  # token 0 asks; a last-slot ask has no answer
    full, n_all, _ = module._loss(batch)
    module.loss_after_id = 0
    loss, counted, right = module._loss(batch)
    logits = module.model(batch[:, :-1])
    rows, cols = [0, 1, 1], [2, 5, 11]
    expected = torch.nn.functional.cross_entropy(logits[rows, cols], batch[rows, [c + 1 for c in cols]])
    assert counted == 3 and n_all == 36 and abs(loss.item() - expected.item()) < 1e-5
    # without loss_only_after: the mean over every next token (a shifted target, or a sum over the batch, passed)
    every = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    assert abs(full.item() - every.item()) < 1e-5
    assert abs(loss.item() - full.item()) > 1e-4  # the other 33 targets are not averaged in
    assert right == (logits[rows, cols].argmax(-1) == batch[rows, [c + 1 for c in cols]]).sum()
    grads = torch.autograd.grad(loss, list(module.parameters()), allow_unused=True)
    wanted = torch.autograd.grad(expected, list(module.parameters()), allow_unused=True)
    for got, want in zip(grads, wanted):  # the same gradient as the loss on the three answers alone
        assert (got is None) == (want is None) and (got is None or torch.allclose(got, want, atol=1e-6))
    empty, counted, _ = module._loss(torch.randint(1, 32, (2, 9)))  # a batch without the token adds nothing
    assert counted == 0 and empty.item() == 0.0
    empty.backward()
    assert all(p.grad is None or not p.grad.any() for p in module.parameters())
    module._add_to_step_loss(loss.detach(), torch.tensor(3))  # a step of two micro-batches, the second without an
    module._add_to_step_loss(empty.detach(), counted)  # answer: train/loss is the first one's, not half of it
    assert abs(module._step_loss()[0].item() - loss.item()) < 1e-6


def _answer_step_gradient(micro_batches, accumulate, world_size=1, reduce=None, monkeypatch=None):
    """The gradient a real fit clips (after on_before_optimizer_step) for one step of data.loss_only_after=token 0."""
    import lightning as L

    class Recorded(LitDecoder):
        def configure_gradient_clipping(self, optimizer, *args, **kwargs):
            self.grads = [p.grad.clone() for p in self.parameters()]
            super().configure_gradient_clipping(optimizer, *args, **kwargs)

    torch.manual_seed(0)
    module = Recorded(model=dict(vocab_size=32, n_layers=1, d_model=16, n_heads=2, max_seq_len=16),
                      attention=dict(kind="swa", window=4), max_steps=1,
                      optim=dict(lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, warmup_steps=0,
                                 min_lr_ratio=0.1))
    module.loss_after_id = 0
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, max_steps=1,
                        accumulate_grad_batches=accumulate, enable_progress_bar=False, enable_model_summary=False)
    if world_size > 1:  # the reduce stands in for the other ranks' answers; DDP's gradient average is theirs too
        monkeypatch.setattr(type(trainer.strategy), "world_size", property(lambda self: world_size), raising=False)
        monkeypatch.setattr(trainer.strategy, "reduce", reduce)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(micro_batches, batch_size=None))
    return module.grads


def test_loss_only_after_weighs_every_answer_of_an_accumulated_step_alike():
    """Two micro-batches, with 1 and 5 answers, give the gradient of one batch holding both: the mean over the 6
    answers. The mean of the two micro-batches' means weighed the lone answer 5 times as much as each of the others."""
    torch.manual_seed(1)
    batches = torch.randint(1, 32, (2, 2, 9))
    batches[0, 0, 3] = 0
    batches[1, 0, [1, 4, 6]] = 0
    batches[1, 1, [2, 5]] = 0
    whole = _answer_step_gradient([batches.reshape(4, 9)], accumulate=1)
    accumulated = _answer_step_gradient(list(batches), accumulate=2)
    assert sum(g.norm() for g in whole) > 0
    for got, want in zip(accumulated, whole):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_loss_only_after_divides_the_gradient_by_the_answers_of_every_rank(monkeypatch):
    """With 2 ranks the step's gradient is divided by the answers counted on both: this rank holds 3, the other 9.
    DDP's average halves each rank's sum and the rescale doubles it back, so this rank's part is its sum / 12, a
    quarter of its own mean (each rank's own mean, averaged, weighed its 3 answers as much as the other's 9)."""
    batch = torch.randint(1, 32, (2, 9))
    batch[0, [2, 6]], batch[1, 3] = 0, 0
    alone = _answer_step_gradient([batch], accumulate=1)
    two = _answer_step_gradient([batch], accumulate=1, world_size=2, monkeypatch=monkeypatch,
                                reduce=lambda t, reduce_op: t + torch.tensor([9.0, 9.0]) if t.shape == (2,) else t)
    for got, want in zip(two, alone):  # other rank: a loss of 1 on 9 answers. No DDP here: this rank's 2 x sum / 12
        torch.testing.assert_close(got, want / 2, rtol=1e-5, atol=1e-7)


def run_cli(args, cwd, env_extra=None, timeout=600):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def cli_tiny(corpus, cache):
    return [a for a in TINY] + ["data=files", f"data.source.paths=[{corpus}]", f"paths.cache_dir={cache}",
                                "trainer.progress_bar=false"]


def test_a_bare_resume_continues_the_run_with_its_own_overrides(tmp_path, corpus_file, data_cache):
    """`python train.py hydra.run.dir=<run> resume=auto` composed the defaults: an SA run on a corpus of its own
    went on as full attention on the embedded corpus, with one warning."""
    run = tmp_path / "run"
    first = run_cli(cli_tiny(corpus_file, data_cache) + ["attention=sa", "attention.window=8", "trainer.max_steps=2",
                                                        "logger=csv", "eval.after_train=false", f"hydra.run.dir={run}"],
                    cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    with open(run / "overrides.yaml", "a") as f:  # recorded before keys nothing reads were refused: it ran without
        f.write("- +optim.warmup=3\n- +max_steps=9\n- +tokens=64\n- trainer.max_steps='${steps:${tokens},16}'\n")
    again = run_cli([f"hydra.run.dir={run}", "resume=auto", "trainer.max_steps=4"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resume: the run's own overrides (" in again.stderr
    assert "resume: left out +optim.warmup=3 of the run's own overrides: nothing reads optim.warmup" in again.stderr
    [warning] = [line for line in again.stderr.splitlines() if "differs from the checkpoint" in line]
    assert "attention" not in warning and "data." not in warning  # nothing changed but the schedule's length
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 4 and saved["hyper_parameters"]["attention"]["kind"] == "sa"
    recorded = (run / "overrides.yaml").read_text()
    assert "attention=sa" in recorded and "trainer.max_steps=4" in recorded and "max_steps=2" not in recorded
    assert "resume: left out +max_steps=9 of the run's own overrides: nothing reads max_steps" in again.stderr
    # today's trainer.max_steps replaces the one that read +tokens: left out too, not refused as today's mistake
    assert "resume: left out +tokens=64 of the run's own overrides: nothing reads tokens" in again.stderr
    assert "+optim.warmup=3" not in recorded and "+max_steps=9" not in recorded
    assert "resume" not in recorded
    # a resume the checkpoint refuses (at load time) leaves the run's record as it was
    config = (run / "config.yaml").read_text()
    refused = run_cli([f"hydra.run.dir={run}", "resume=auto", "trainer.max_steps=6", 'data.loss_only_after=" the"'],
                      cwd=tmp_path)
    assert refused.returncode == 2 and "data.loss_only_after" in refused.stderr
    assert (run / "overrides.yaml").read_text() == recorded and (run / "config.yaml").read_text() == config
    log = (run / "train.log").read_text()  # what the run said, beside Lightning's lines
    assert "model: " in log and "resume: the run's own overrides" in log and "error: invalid config" in log
    assert "val loss      :" in log and "[bold]" not in log
    assert "UserWarning: resuming with a config that differs from the checkpoint's" in log  # a warning, logged too
    assert " documents) in " in log  # the data line says how many documents validation holds
    # a run started from another's weights resumes from its own checkpoint: a source moved since is no error
    second = tmp_path / "second"
    started = run_cli(cli_tiny(corpus_file, data_cache) + ["attention=gated_sa_swa", "attention.window=8",
                                                          "trainer.max_steps=2", "logger=csv", "eval.after_train=false",
                                                          f"init_from={run}", f"hydra.run.dir={second}"], cwd=tmp_path)
    assert started.returncode == 0, started.stderr[-2000:]
    run.rename(tmp_path / "moved")
    resumed = run_cli([f"hydra.run.dir={second}", "resume=auto", "trainer.max_steps=3"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    # killed before its first checkpoint: resume=auto starts it again as it was started, not as the defaults, and
    # from init_from's weights, not random ones; a source that has moved since is asked for, not left out
    for path in (second / "checkpoints").iterdir():
        path.unlink()
    lost = run_cli([f"hydra.run.dir={second}", "resume=auto", "trainer.max_steps=1"], cwd=tmp_path)
    assert lost.returncode == 2 and "init_from" in lost.stderr and "give init_from=<where it is now>" in lost.stderr
    again = run_cli([f"hydra.run.dir={second}", "resume=auto", "trainer.max_steps=1",
                     f"init_from={tmp_path / 'moved'}"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    restarted = torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert restarted["attention"]["kind"] == "gated_sa_swa" and restarted["model"]["n_layers"] == 2
    assert restarted["init_from"]["checkpoint"].startswith(str(tmp_path / "moved"))


def test_ddp_on_two_cpu_processes_trains_as_one_process_with_both_ranks_batches(tmp_path, corpus_file, data_cache):
    """Two ranks of batch 4 share out the windows one process of batch 8 takes, and average their gradients: the same
    losses and weights (SWA: SA's pi differs by rank by design)."""
    common = cli_tiny(corpus_file, data_cache) + ["attention=swa", "attention.window=8", "trainer.max_steps=4",
                                                  "trainer.val_every_n_steps=2", "logger=csv"]
    runs = {"ddp": ["trainer=ddp_cpu"], "one": ["data.batch_size=8"]}
    for name, extra in runs.items():
        res = run_cli(common + extra + [f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
    ckpts = {name: torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
             for name in runs}
    assert ckpts["ddp"]["global_step"] == 4
    tokens = read_metrics(tmp_path / "ddp")["train/tokens"]
    assert tokens[max(tokens)] == 4 * 2 * 4 * 64  # steps x world size x batch x seq_len
    losses = {name: read_metrics(tmp_path / name)["train/loss"] for name in runs}  # over both ranks' targets
    assert len(losses["ddp"]) == 4 and losses["ddp"].keys() == losses["one"].keys()
    for step, loss in losses["ddp"].items():
        assert loss == pytest.approx(losses["one"][step], rel=1e-4), step
    for key, weight in ckpts["one"]["state_dict"].items():
        torch.testing.assert_close(ckpts["ddp"]["state_dict"][key], weight, rtol=1e-4, atol=1e-5, msg=key)


def test_multirun_runs_one_job_per_variant(tmp_path, corpus_file, data_cache):
    res = run_cli(["-m", "attention=full,swa,sa,gated_sa_swa", "trainer.max_steps=2", "trainer.val_every_n_steps=2",
                   "logger=csv"] + cli_tiny(corpus_file, data_cache), cwd=tmp_path)  # default paths, as documented
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = sorted(p.name for p in (tmp_path / "runs" / "train" / "multirun").glob("*/*") if p.is_dir())
    assert [j.split("_")[1] for j in jobs] == ["full", "swa", "sa", "gated"]
    for job in (tmp_path / "runs" / "train" / "multirun").glob("*/*/"):
        assert (job / "checkpoints" / "last.ckpt").is_file() and (job / "metrics.csv").is_file()


def test_paper_preset_without_hub_reports_params_and_how_to_fix(tmp_path):
    res = run_cli(["experiment=paper_360m", "logger=csv", f"paths.log_dir={tmp_path}", f"paths.cache_dir={tmp_path}"],
                  cwd=tmp_path, timeout=120)
    assert res.returncode != 0
    out = res.stdout + res.stderr
    params = [line for line in out.splitlines() if "M parameters" in line]
    assert params and 340 <= float(params[0].split("model:")[1].split("M")[0]) <= 380
    assert "data=files" in out and "data.source.paths" in out


@pytest.mark.parametrize("attention", ["sa", "gated_sa_swa"])
def test_triton_backend_trains_like_torch_backend(attention, tmp_path, corpus_file, data_cache):
    """Under TRITON_INTERPRET=1 on CPU the fused kernels must reproduce the torch backend's training losses."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs a GPU or the Triton interpreter")
    losses = {}
    for backend in ("torch", "triton"):
        cfg = compose_train(TINY + [f"attention={attention}", "attention.window=8", f"attention.backend={backend}",
                                    "trainer.max_steps=3", "trainer.val_every_n_steps=3", "data.batch_size=2"],
                            tmp_path / backend, corpus_file, data_cache)
        train(cfg)
        losses[backend] = read_metrics(tmp_path / backend)["train/loss"]
    assert sorted(losses["triton"]) == [0, 1, 2]
    for step, value in losses["torch"].items():
        assert abs(losses["triton"][step] - value) <= 1e-4, step


def test_chunked_loss_trains_like_the_whole_batch_loss(tmp_path, corpus_file, data_cache, monkeypatch):
    """trainer.loss_chunk_tokens=100 (a micro-batch of 4 x 64 targets in three chunks): the same training curve."""
    import model.loss

    chunked_calls = []
    real = model.loss._chunked
    monkeypatch.setattr(model.loss, "_chunked", lambda *args: chunked_calls.append(args[3]) or real(*args))
    losses = {}
    for chunk in (0, 100):
        cfg = compose_train(TINY + ["attention=sa", "attention.window=8", f"trainer.loss_chunk_tokens={chunk}",
                                    "trainer.max_steps=4", "trainer.val_every_n_steps=4"],
                            tmp_path / str(chunk), corpus_file, data_cache)
        train(cfg)
        losses[chunk] = read_metrics(tmp_path / str(chunk))
    assert sorted(losses[100]["train/loss"]) == [0, 1, 2, 3]
    assert chunked_calls and set(chunked_calls) == {100}  # the second run's steps and validations went through it
    for key in ("train/loss", "val/loss"):
        for step, value in losses[0][key].items():
            assert abs(losses[100][key][step] - value) <= 1e-4, (key, step)


def test_last_checkpoint_holds_the_final_step_between_checkpoint_intervals(tmp_path, corpus_file, data_cache):
    """max_steps=5 with a checkpoint every 4 steps: last.ckpt (what evaluation loads) is step 5, not step 4."""
    cfg = compose_train(TINY + ["trainer.max_steps=5", "trainer.val_every_n_steps=5",
                                "trainer.checkpoint_every_n_steps=4"], tmp_path / "run", corpus_file, data_cache)
    train(cfg)
    ckpt_dir = tmp_path / "run" / "checkpoints"
    for name, step in (("last.ckpt", 5), ("step0000005.ckpt", 5), ("step0000004.ckpt", 4)):
        assert torch.load(ckpt_dir / name, weights_only=True, map_location="cpu")["global_step"] == step, name


def test_compiled_training_reproduces_eager_losses(tmp_path, corpus_file, data_cache):
    """trainer.compile=true (each block one compiled graph) trains like the eager model; its checkpoint loads into
    an uncompiled decoder (parameter names unchanged)."""
    from model.checkpoint import load_checkpoint

    losses, gates, graphs = {}, {}, {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cfg = compose_train(TINY + ["attention=gated_sa_swa", "attention.window=8", f"trainer.compile={compiled}",
                                    "trainer.max_steps=3", "trainer.val_every_n_steps=3", "data.batch_size=2"],
                            tmp_path / str(compiled), corpus_file, data_cache)
        train(cfg)
        logged = read_metrics(tmp_path / str(compiled))
        losses[compiled], gates[compiled] = logged["train/loss"], logged["gates/sa/layer01"]
        graphs[compiled] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    # training, plus validation before and during fit (Lightning's inference mode gives tensors without autograd
    # keys, another guard); a fresh pi at each step must not add any, nor the gates' eager pass at validation
    assert graphs[False] == 0 and 1 <= graphs[True] <= 3, graphs
    assert sorted(losses[True]) == [0, 1, 2]
    for step, value in losses[False].items():
        assert abs(losses[True][step] - value) <= 1e-4, step
    assert sorted(gates[True]) == [0, 3] and abs(gates[True][3] - gates[False][3]) <= 1e-4
    loaded = load_checkpoint(tmp_path / "True")
    assert loaded.model.attn_cfg.kind == "gated_sa_swa"


def test_training_ends_with_the_evaluation_suite(tmp_path, corpus_file, data_cache, capsys):
    """eval.after_train: the final checkpoint is scored offline; the numbers land in the run's CSV log too."""
    from test_evaluation import make_truth, wiki_articles, write_evaldata

    evaldata = write_evaldata(tmp_path / "evaldata", make_truth(), wiki_articles(3))
    cfg = compose_train(TINY + ["trainer.max_steps=4", "trainer.val_every_n_steps=4", "eval.after_train=true",
                                f"eval.data_dir={evaldata}", "eval.limit=4"], tmp_path / "run", corpus_file,
                        tmp_path / "cache")
    metrics = train(cfg)
    results = tmp_path / "run" / "eval" / "quick" / "results.json"
    assert results.is_file() and (results.parent / "results.md").is_file()
    # the converted tasks are cached beside the run's data (paths.cache_dir), not in the repository's .cache
    assert list((tmp_path / "cache" / "eval_tasks").glob("*/wikitext.yaml"))
    assert "eval/lambada_openai/acc" in metrics and "eval/wikitext/word_perplexity" in metrics
    assert "eval/wikitext/word_perplexity" in read_metrics(tmp_path / "run")


def test_training_without_eval_data_still_succeeds(tmp_path, corpus_file, data_cache, capsys):
    cfg = compose_train(TINY + ["trainer.max_steps=2", "trainer.val_every_n_steps=2", "eval.after_train=true"],
                        tmp_path / "run", corpus_file, data_cache)
    metrics = train(cfg)
    err = capsys.readouterr().err
    assert "eval.data_dir" in err and "held-out perplexity" in err
    assert "val/ppl" in metrics


@pytest.mark.parametrize("accumulate,val_every", [(1, 1), (3, 1000)])
def test_sigterm_saves_the_step_reached_exits_143_and_resumes_exactly(accumulate, val_every, tmp_path, corpus_file,
                                                                        data_cache):
    """Lightning stops on SIGTERM (scancel, preemption) with exit code 0 and no checkpoint of the step reached: a
    sweep went on to its next job as if this one had finished, and the resume went back to the periodic checkpoint.
    With accumulation the signal mostly arrives mid-step: the stop waits for the step's end. Validating every step,
    Lightning stopped inside the validation, where nothing was saved: the stop waits for the validation's end."""
    import signal
    import time

    run_dir = tmp_path / "run"
    settings = ["attention=sa", "attention.window=8", "optim.schedule_steps=50", "data.val_batch_size=1",
                f"trainer.val_every_n_steps={val_every}", f"trainer.accumulate_grad_batches={accumulate}"]
    common = cli_tiny(corpus_file, data_cache) + settings + ["logger=csv", "trainer.checkpoint_every_n_steps=4",
                                                             f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *common, "trainer.max_steps=100000"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (run_dir / "checkpoints" / "step0000004.ckpt").is_file() and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)  # a few steps past the periodic checkpoint
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "stopped by SIGTERM" in err and "SIGTERM: saved" in err, err[-3000:]
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"]
    assert step > 4 and (run_dir / "checkpoints" / f"step{step:07d}.ckpt").is_file()
    res = run_cli(common + [f"trainer.max_steps={step + 2}", "resume=auto"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = read_run_metrics(run_dir / "metrics.csv")["train/loss"]
    whole = read_metrics_after(compose_train(TINY + settings + [f"trainer.max_steps={step + 2}"], tmp_path / "whole",
                                             corpus_file, data_cache))["train/loss"]
    assert sorted(resumed) == sorted(whole) == list(range(step + 2))
    for s in whole:
        assert abs(resumed[s] - whole[s]) <= 1e-6, s


def test_a_resume_on_another_layout_is_warned_about(tmp_path, corpus_file, data_cache):
    """Another accumulation (or world size) starts the data stream at another index: batches may repeat. The
    checkpoint did not record how its steps were cut, so the change went unnoticed."""
    common = TINY + ["attention=sa", "attention.window=8", "optim.schedule_steps=6", "trainer.val_every_n_steps=3"]
    run = tmp_path / "run"
    train(compose_train(common + ["trainer.max_steps=3"], run, corpus_file, data_cache))
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert saved["layout"] == {"world_size": 1, "accumulate_grad_batches": 1, "fsdp": False}
    with pytest.warns(UserWarning, match=r"another layout \(accumulate_grad_batches: 1 -> 2\)"):
        train(compose_train(common + ["trainer.max_steps=4", "resume=auto", "trainer.accumulate_grad_batches=2"],
                            run, corpus_file, data_cache))


def test_sigterm_to_every_rank_of_a_ddp_job_stops_them_together(tmp_path, corpus_file, data_cache):
    """scancel signals every rank; Lightning's handler ran a collective inside the signal handler on each, the
    collectives no longer matched and the job hung (3 runs of 4). Now the ranks agree at a step's end."""
    import signal
    import time

    run_dir = tmp_path / "ddp"
    args = cli_tiny(corpus_file, data_cache) + ["trainer=ddp_cpu", "attention=sa", "attention.window=8",
                                                "optim.schedule_steps=50", "trainer.val_every_n_steps=1000",
                                                "trainer.checkpoint_every_n_steps=4", "logger=csv",
                                                f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, "trainer.max_steps=100000"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: the ranks, as a job step's
    try:
        deadline = time.time() + 300
        while not (run_dir / "checkpoints" / "step0000004.ckpt").is_file() and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143 and "SIGTERM: saved" in err, err[-3000:]
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"]
    assert step > 4
    res = run_cli(args + [f"trainer.max_steps={step + 2}", "resume=auto"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(read_run_metrics(run_dir / "metrics.csv")["train/loss"]) == list(range(step + 2))


@pytest.mark.parametrize("env,zero", [({}, True), ({"RANK": "0", "LOCAL_RANK": "0"}, True), ({"RANK": "3"}, False),
                                      ({"SLURM_PROCID": "1"}, False), ({"SLURM_PROCID": "0"}, True),
                                      ({"SLURM_PROCID": "0", "LOCAL_RANK": "1"}, False),  # srun --pty: Lightning's
                                      ({"SLURM_PROCID": "0", "NODE_RANK": "2"}, False)])
def test_rank_zero_is_read_from_the_launchers_variables(env, zero, monkeypatch):
    from tools.resume import is_global_zero_from_env

    for key in ("RANK", "SLURM_PROCID", "NODE_RANK", "GROUP_RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert is_global_zero_from_env() is zero


def test_fsdp_keeps_the_numerics_of_ddp_under_mixed_precision():
    """bf16-mixed under FSDP gathers fp32 weights and reduces fp32 gradients, as DDP keeps them (Lightning's default
    gathers bf16 weights: a bf16 residual stream); a -true precision keeps Lightning's own config."""
    from omegaconf import OmegaConf

    from train import _fsdp_strategy

    from tools.train_config import trainer_precision

    cfg = OmegaConf.create({"trainer": {"activation_checkpointing": False}})
    for precision in ("bf16-mixed", "bf16", "16", 16):  # Lightning's short names are mixed precisions
        cfg.trainer.precision = precision
        mp = _fsdp_strategy(cfg, trainer_precision(cfg, True)).mixed_precision_config
        assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (torch.float32,) * 3, precision
    for precision in ("bf16-true", 32, "64"):
        cfg.trainer.precision = precision
        assert _fsdp_strategy(cfg, trainer_precision(cfg, True)).mixed_precision is None, precision


def test_multirun_ddp_counts_a_list_of_device_ids_as_that_many_processes():
    """trainer.devices=[0,1] under -m starts two ranks (refused); [0] is one process (allowed); single runs pass."""
    from omegaconf import OmegaConf

    from tools.guards import multirun_ddp_problem

    def cfg(devices, strategy="ddp"):
        return OmegaConf.create({"trainer": {"strategy": strategy, "devices": devices, "num_nodes": 1}})

    assert "2 processes" in multirun_ddp_problem(cfg([0, 1]), multirun=True)
    assert multirun_ddp_problem(cfg([0]), multirun=True) is None
    assert multirun_ddp_problem(cfg([0, 1]), multirun=False) is None
    assert multirun_ddp_problem(cfg(2, strategy="deepspeed"), multirun=True) is None
