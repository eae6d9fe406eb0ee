"""Refuse launch combinations that cannot work: Hydra multirun (-m) with the subprocess DDP launcher.

Lightning's `ddp`/`fsdp` strategies (and `auto` with several devices) start ranks 1.. by re-executing the command
line; under `-m` every rank re-runs the WHOLE sweep into its own multirun folder and only works while all ranks step
through the jobs in lockstep (shared/docs/environment.md section 4). Supported instead:
  * sweeps with one device per job:   python train.py -m experiment=ablation trainer.devices=1
  * multi-device runs one at a time:
        for v in full swa sa gated_sa_swa; do python train.py attention=$v trainer=ddp; done

Where it applies:
  * train.py's check_config (tools/train_config.py) calls `refuse_multirun_ddp(cfg)` for every run, so every
    multirun is refused;
  * the sweep presets in conf/experiment/ also register it as a Hydra callback, which stops before the first job:
        hydra: {callbacks: {multirun_guard: {_target_: tools.guards.MultirunDDPGuard}}}
"""

from __future__ import annotations

from model.config import ConfigError

SUBPROCESS_STRATEGIES = ("ddp", "fsdp", "auto")


def _devices_per_node(trainer) -> int | None:
    """The number of devices a job would use per node; None when it depends on the machine (-1 / 'auto')."""
    devices = trainer.get("devices", 1)
    if devices in (-1, "-1", "auto"):
        try:
            import torch

            if trainer.get("accelerator", "auto") in ("gpu", "cuda", "auto") and torch.cuda.is_available():
                return torch.cuda.device_count()
        except ImportError:  # pragma: no cover
            return None
        return 1
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        return len(devices)
    return int(devices)


def multirun_ddp_problem(cfg, multirun: bool) -> str | None:
    """Why this config cannot run as one job of a Hydra multirun (None when it can)."""
    if not multirun or cfg.get("trainer") is None:
        return None
    trainer = cfg.trainer
    strategy = str(trainer.get("strategy", "auto"))
    devices = _devices_per_node(trainer)
    world = None if devices is None else devices * int(trainer.get("num_nodes", 1))
    if strategy not in SUBPROCESS_STRATEGIES or world == 1:
        return None
    return (f"Hydra multirun (-m) cannot use trainer.strategy={strategy} with {world or 'several'} processes "
            f"(trainer.devices={trainer.get('devices')}, trainer.num_nodes={trainer.get('num_nodes', 1)}): the DDP "
            "launcher re-executes the command line, so every rank would re-run the whole sweep. Run sweeps with one "
            "device per job (trainer.devices=1, e.g. trainer=default), or launch multi-device runs one at a time "
            "without -m (see tools/README.md)")


def is_multirun() -> bool:
    """True inside a job of `python train.py -m ...` (False for single runs and the compose API)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False
    return HydraConfig.get().mode == RunMode.MULTIRUN


def refuse_multirun_ddp(cfg, multirun: bool | None = None) -> None:
    """Raise ConfigError (train.py prints it as `error: invalid config: ...`, exit 2) for multirun + DDP."""
    why = multirun_ddp_problem(cfg, is_multirun() if multirun is None else multirun)
    if why:
        raise ConfigError("trainer.strategy", cfg.trainer.get("strategy"), why)


try:
    from hydra.experimental.callback import Callback as _Callback
except ImportError:  # pragma: no cover
    _Callback = object


class MultirunDDPGuard(_Callback):
    """Hydra callback: refuse before the first job (plain overrides) and before each job (swept ones).

    Hydra turns an Exception raised by a callback into a warning and carries on, so the guard prints the error the
    way train.py does and leaves with SystemExit(2), which Hydra does not catch."""

    def on_multirun_start(self, config, **kwargs) -> None:
        _exit_on_error(refuse_multirun_ddp, config, multirun=True)
        for job in _swept_trainer_configs(config):  # `-m trainer=default,ddp`: refuse before the first job too
            _exit_on_error(refuse_multirun_ddp, job, multirun=True)

    def on_job_start(self, config, **kwargs) -> None:
        from hydra.types import RunMode

        _exit_on_error(refuse_multirun_ddp, config, multirun=config.hydra.mode == RunMode.MULTIRUN)


def _swept_trainer_configs(config):
    """The configs of every value of a sweep over trainer keys (other sweeps left at their defaults)."""
    import itertools

    try:
        from hydra import compose
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
        fixed, swept = {}, {}
        for o in OverridesParser.create().parse_overrides(params + list(config.hydra.overrides.task)):
            key = o.get_key_element()
            is_trainer = key.lstrip("+~").split(".")[0].split("@")[0] == "trainer"
            fixed.pop(key, None)
            swept.pop(key, None)
            if o.is_sweep_override():
                if is_trainer and o.is_discrete_sweep():
                    swept[key] = [f"{key}={v}" for v in o.sweep_string_iterator()]
            else:
                fixed[key] = f"{key}={o.get_value_element_as_str()}"
        for combo in itertools.product(*swept.values()) if swept else []:
            yield compose(config_name=config.hydra.job.config_name, overrides=list(fixed.values()) + list(combo))
    except Exception:  # noqa: BLE001 - best effort: each job is checked again before it starts
        return


def _exit_on_error(fn, *args, **kwargs) -> None:
    import sys

    try:
        fn(*args, **kwargs)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from err
