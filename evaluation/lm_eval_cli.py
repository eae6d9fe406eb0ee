"""lm-eval's own command line, with our model registered: ``python -m evaluation.lm_eval_cli <lm-eval arguments>``.

lm-eval 0.4.13 finds a model name only in its registry, which holds its built-in models plus whatever modules the
process imported (there is no plugin / entry-point discovery for models). A plain ``lm_eval --model sa-lm`` therefore
cannot see this repository's model; this wrapper imports ``evaluation.lm`` (registering "sa-lm") and then runs
``lm_eval.__main__.cli_evaluate`` unchanged, so every lm-eval option works:

    python -m evaluation.lm_eval_cli --model sa-lm --model_args checkpoint=runs/train/<run>,window=64 \\
        --tasks wikitext,lambada_openai --batch_size 16 --output_path out/

One extra option, ``--data_dir <folder in the layout of shared/evaldata>``, writes the local (offline) task
definitions for the requested tasks (evaluation/local_tasks.py) and passes their folder as ``--include_path``; the
local tasks then replace the hub ones of the same name. ``--num_fewshot k > 0`` is refused for a local task without
a non-test split (lm-eval would take its examples from the test split it scores).
"""

from __future__ import annotations

import sys


def _pop_option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i: i + 2]
            return value
        if arg.startswith(name + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def _options(argv: list[str]):
    """The options this wrapper reads, in every spelling lm-eval's parser takes: abbreviations (--task, --batch),
    attached values (-t=piqa, -f5, --batch_size=8), several task values (--tasks piqa arc_easy)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    for flags in (("--model", "-M"), ("--batch_size", "-b"), ("--config", "-C"), ("--num_fewshot", "-f"),
                  ("--include_path",)):
        parser.add_argument(*flags)
    parser.add_argument("--tasks", "-t", nargs="+")
    known, _ = parser.parse_known_args(argv)
    return known


def _requested_tasks(argv: list[str]) -> list[str]:
    return [t for value in (_options(argv).tasks or []) for t in value.split(",") if t]


def _needs_batch_size(argv: list[str]) -> bool:
    """Whether this is sa-lm with no batch size given in any spelling nor a --config file, which may set one."""
    known = _options(argv)
    return known.model == "sa-lm" and known.batch_size is None and known.config is None


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    data_dir = _pop_option(argv, "--data_dir")
    if data_dir is not None:
        from evaluation.local_tasks import KNOWN_TASKS, check_fewshot, write_local_tasks
        from evaluation.runner import default_task_dir

        if _options(argv).include_path is not None:
            sys.exit("error: --data_dir writes its own --include_path; give one or the other")
        wanted = [t for t in _requested_tasks(argv) if t in KNOWN_TASKS] or list(KNOWN_TASKS)
        task_dir = default_task_dir(data_dir)
        local = write_local_tasks(data_dir, wanted, task_dir, cache_dir=task_dir / "hf_datasets")
        shots = _options(argv).num_fewshot  # read, left in argv
        try:
            check_fewshot(local, _requested_tasks(argv), shots, "--num_fewshot")
        except ValueError as err:  # a model.config.ConfigError, or a --num_fewshot that is not a number
            sys.exit(f"error: {err}")
        for name, why in local.missing.items():
            print(f"sa-lm: {name} is not available locally ({why}); lm-eval will try the HF hub", file=sys.stderr)
        argv += ["--include_path", str(local.task_dir)]

    if _needs_batch_size(argv):
        argv += ["--batch_size", "16"]  # sa-lm's own default; lm-eval's CLI would pass its 1, 16x the forward calls

    import evaluation.lm  # noqa: F401  (registers "sa-lm")
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
