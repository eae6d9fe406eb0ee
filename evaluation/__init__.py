"""Evaluation of trained checkpoints with lm-evaluation-harness (see evaluation/README.md).

evaluation.lm           the lm-eval model class "sa-lm"
evaluation.local_tasks  offline task definitions (official lm-eval tasks fed from local files)
evaluation.runner       evaluate_checkpoint(): suites, SA seeds, results JSON + markdown
evaluation.report       reported metrics and the paper-shaped table
evaluation.lm_eval_cli  `python -m evaluation.lm_eval_cli ...` = lm-eval's CLI with "sa-lm" registered
"""

from evaluation.runner import evaluate_checkpoint

__all__ = ["evaluate_checkpoint"]
