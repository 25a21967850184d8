"""The command line, built on LightningCLI: ``python -m lightning_app_rlhf fit --config CONFIG.yaml``.

Besides the Trainer's ``fit``, ``validate``, ``test`` and ``predict``, ``plan`` predicts and searches placements for
the same config without training (``plan --config CONFIG.yaml --cluster 1x4xcpu``), or for named model sizes
(``plan --cluster 1x8xA100-80GB --actor llama-7b``). Its flags and printing live in ``planner/command.py``; this
module only reads the parsed config into a :class:`~lightning_app_rlhf.planner.command.TrainingRun`.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, NoReturn

import docstring_parser
import torch
from jsonargparse import ActionYesNo, Namespace, set_parsing_settings
from jsonargparse._typehints import ActionTypeHint
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_app_rlhf.calibration_run import measure_phases
from lightning_app_rlhf.callbacks.placement_tuner import PlacementTuner
from lightning_app_rlhf.callbacks.defaults import missing_default_callbacks
from lightning_app_rlhf.checkpoint.format import (
    CheckpointError,
    is_sharded_checkpoint,
    load_checkpoint_file,
)
from lightning_app_rlhf.checkpoint.newest import AUTO, newest_complete_checkpoint
from lightning_app_rlhf.core.upstream_warnings import ignore_upstream_warnings
from lightning_app_rlhf.core.user_errors import causes, first_report, missing_package, one_line, user_frames
from lightning_app_rlhf.data import PromptDataModule
from lightning_app_rlhf.generation import registered_backends
from lightning_app_rlhf.models.roles import ModelSpec
from lightning_app_rlhf.module import RLHFModule
from lightning_app_rlhf.parallel.failures import PlacementError
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.planner.cluster import known_devices
from lightning_app_rlhf.planner.command import (
    CALIBRATION_ITERATIONS,
    PlanOptions,
    TrainingRun,
    report_error,
    run_plan_command,
    workload_name,
)
from lightning_app_rlhf.planner.workload import workload_from_data
from lightning_app_rlhf.strategies.placement_setup import checked_plan
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy

PLAN = "plan"
"""The subcommand that runs the planner instead of a Trainer method."""
PLAN_HELP = "Predict and search placements for the configured run, or for named model sizes (a dry run: no training)."
DEBUG_FLAG = "--debug"
"""Anywhere on the command line: an error in the config or on the command line raises with its traceback."""
DEBUG_ENV = "LIGHTNING_APP_RLHF_DEBUG"
"""``LIGHTNING_APP_RLHF_DEBUG=1`` does what ``--debug`` does (``--debug`` sets it, for the ranks a launcher starts)."""
DEBUG_HELP = (f"An error in the config or on the command line prints one line naming the fix; add {DEBUG_FLAG} "
              f"(or set {DEBUG_ENV}=1) for its traceback.")
DESCRIPTION = ("RLHF with placement strategies: train (fit), evaluate (validate, test, predict), or plan the placement "
               f"of the model calls (plan). {DEBUG_HELP}")
CONFIG_ERRORS = (ValueError, FileNotFoundError, ImportError)
"""What this package raises for a setting it refuses (its message names the fix): printed as one ``error:`` line
when raised by this package's own code (:func:`config_error`)."""


LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc", "registry")
"""``--ckpt_path`` values that name a checkpoint Lightning finds: ModelCheckpoint's last or best, SLURM's."""


class RLHFArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one line: a mistyped option gets the nearest valid one ("did you mean
    --model.ppo.kl_coef?"), and the usage, some 150 lines that would bury the error, is left to ``--help``. With
    ``--debug`` an error raises with its traceback instead. An option is never taken for a longer one it begins
    (``--model.generation.max_new_token`` is an error suggesting ``max_new_tokens``, not that option)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # argparse's prefix matching would read a typo as another option
        super().__init__(*args, **kwargs)

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Exit 2 with ``error: MESSAGE`` (jsonargparse's many-line refusals in one line, naming the nearest options
        of unrecognized ones, and ``--help``); raise where jsonargparse would (``exit_on_error=False`` while it tries
        alternatives) or under ``--debug``."""
        if not self.exit_on_error:
            super().error(message, ex)  # raises: a caller tries something else, or reports it as its own error
        message = one_line(message)
        hint = "" if "Did you mean" in message else (class_option_hint(message) or
                                                      suggest_options(message, option_strings(self, ex)))
        message = f"{message.rstrip(' .')}.{hint}" if hint else message
        if debug_requested():
            raise argparse.ArgumentError(None, message) from ex
        prog = (getattr(ex, "subcommand_parser", None) or self).prog.replace(" [options]", "")
        sys.stderr.write(f"error: {message} ({prog} --help lists the options; {DEBUG_FLAG} shows the traceback.)\n")
        self.exit(2)


def option_strings(parser: argparse.ArgumentParser, ex: Exception | None = None) -> list[str]:
    """Every ``--option`` of ``parser``, of its subcommands' parsers, and of the parser ``ex`` names, if any."""
    parsers, options = [parser, *([ex.subcommand_parser] if getattr(ex, "subcommand_parser", None) else [])], []
    while parsers:
        current = parsers.pop()
        for action in current._actions:
            options += [option for option in action.option_strings if option.startswith("--")]
            parsers += list(getattr(action, "_name_parser_map", {}).values())  # the subcommands
    return list(dict.fromkeys(options))


def suggest_options(message: str, options: Sequence[str]) -> str:
    """`` Did you mean --X?`` for each option that ``message`` refuses (jsonargparse's "unrecognized arguments:
    --a.b 1 ..." of the command line, "does not accept option 'a.b'" of a config file) that is close to one of
    ``options`` (difflib, as for strategy names); "" when none is."""
    if message.startswith("unrecognized arguments:"):
        flags = [word.split("=", 1)[0] for word in message.split(":", 1)[1].split() if word.startswith("--")]
    else:
        flags = ["--" + key for key in re.findall(r"does not accept (?:nested key|option) '([\w.]+)'", message)]
    pairs = [(flag, close[0]) for flag in flags if (close := difflib.get_close_matches(flag, options, n=1, cutoff=0.8))]
    if len(pairs) == 1:
        return f" Did you mean {pairs[0][1]}?"
    return f" Did you mean {', '.join(f'{close} (for {flag})' for flag, close in pairs)}?" if pairs else ""


def init_arg_names(cls: type) -> dict[str, list[str]]:
    """The arguments of ``cls``'s ``__init__``, and of its bases' where it passes ``**kwargs`` on (as jsonargparse
    reads them for ``--trainer.strategy.*``), by the class that takes them, ``cls`` first."""
    names: dict[str, list[str]] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        parameters = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]
        names[klass.__name__] = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names


def class_option_hint(message: str) -> str:
    """`` Did you mean --trainer.strategy.max_staleness?`` and the class's own options, for a message of
    :func:`~lightning_app_rlhf.core.user_errors.one_line` refusing an option of a class; "" for any other."""
    match = re.match(r"(--[\w.]+)\.(\w+) is not an option of ([\w.]+)", message)
    if match is None:
        return ""
    base, key, class_path = match.groups()
    try:
        module, _, name = class_path.rpartition(".")
        by_class = init_arg_names(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, TypeError, ValueError):
        return ""
    everything = list(dict.fromkeys(n for names in by_class.values() for n in names))
    close = difflib.get_close_matches(key, everything, n=1, cutoff=0.6)
    hint = f" Did you mean {base}.{close[0]}?" if close else ""
    (own_class, own), *bases = by_class.items() or [(name, [])]
    more = f", and those of {', '.join(c for c, _ in bases)}" if bases else ""
    return f"{hint} The options of {own_class}: {', '.join(own) or 'none'}{more}."


def debug_requested() -> bool:
    """Whether ``--debug`` was given (it sets ``LIGHTNING_APP_RLHF_DEBUG``) or the variable is set: errors raise with
    their traceback instead of printing one line."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def config_error(error: BaseException) -> BaseException | None:
    """The error of a setting this package refused, if ``error`` is one or wraps one (jsonargparse re-raises a class's
    error with it as the cause): a :data:`CONFIG_ERRORS` raised by this package's own code, whose message names the
    fix. None: an error whose traceback should show, also one of ours caused by an error of another kind (a
    ``KeyError`` in the user's function, say), whose traceback is the useful part.

    Args:
        error: What the command raised.
    """
    while error is not None:
        if isinstance(error, CONFIG_ERRORS) and _raised_here(error):
            cause = error.__cause__
            return error if cause is None or isinstance(cause, (*CONFIG_ERRORS, OSError)) else None
        error = error.__cause__
    return None


class RLHFCLI(LightningCLI):
    """LightningCLI for :class:`RLHFModule` and :class:`PromptDataModule`; the model's tokenizer feeds the data."""

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """LightningCLI's Trainer subcommands, and ``plan``."""
        return {**LightningCLI.subcommands(), PLAN: set()}

    def __init__(self, *args: Any, only_subcommand: str | None = None, **kwargs: Any) -> None:
        """LightningCLI's arguments, and the subcommand the command line starts with (None: not known), the only one
        whose parser is then built: building each takes about 0.35 s of CPU, on every rank of a fit."""
        self._only_subcommand = only_subcommand
        super().__init__(*args, **kwargs)

    @override
    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """LightningCLI's subcommand parsers, each Trainer method's from its signature; ``plan`` is no Trainer
        method, so its parser comes from :meth:`_prepare_plan_parser`. Only the command line's subcommand when it
        names one (``fit --help`` shows the same), else all of them (``--help`` lists them)."""
        self._subcommand_parsers: dict[str, LightningArgumentParser] = {}
        subcommands = parser.add_subcommands()
        names = list(self.subcommands())
        for name in [self._only_subcommand] if self._only_subcommand in names else names:
            subparser_kwargs = kwargs.get(name, {})
            subparser_kwargs.setdefault("epilog", DEBUG_HELP)
            if name == PLAN:
                description = PLAN_HELP
                subparser_kwargs.setdefault("description", description)
                subparser = self._prepare_plan_parser(**subparser_kwargs)
            else:
                description = _first_sentence(getattr(self.trainer_class, name))
                subparser_kwargs.setdefault("description", description)
                subparser = self._prepare_subcommand_parser(self.trainer_class, name, **subparser_kwargs)
            _list_registered_backends(subparser)
            _accept_strategy_options(subparser)
            if name == "predict":
                _add_predictions_option(subparser)
            self._subcommand_parsers[name] = subparser
            subcommands.add_subcommand(name, subparser, help=description)

    def _prepare_plan_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """``--config``, ``--seed_everything``, ``--trainer.*``, ``--model.*`` and ``--data.*`` as for ``fit``, then the
        flags of :class:`PlanOptions`. The model and the data are optional: without them ``plan`` plans named
        sizes."""
        parser = self.init_parser(**kwargs)
        self.add_default_arguments_to_parser(parser)
        parser.set_defaults(seed_everything=False)  # planning draws nothing at random (--seed seeds the chain)
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=True, required=False)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=True, required=False)
        parser.link_arguments("model.init_args.tokenizer", "data.init_args.tokenizer")
        switches = [f.name for f in fields(PlanOptions) if f.type == "bool"]
        added = parser.add_class_arguments(PlanOptions, instantiate=False, skip=set(switches))
        help_texts = {p.arg_name: p.description for p in docstring_parser.parse_from_object(PlanOptions).params}
        for switch in switches:  # --json, --json true, --no_json
            parser.add_argument(f"--{switch}", action=ActionYesNo, nargs="?", default=False, help=help_texts[switch])
        self._subcommand_method_arguments[PLAN] = [*added, *switches]
        return parser

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.tokenizer", "data.tokenizer")
        _accept_strategy_options(parser)  # also without subcommands (``run=False``)

    @override
    def instantiate_classes(self) -> None:
        if self.subcommand != PLAN:
            super().instantiate_classes()  # a setting the classes refuse: one error: line (main)
            return
        # No Trainer (the config's accelerator and devices need not exist on this machine) and no models:
        # RLHFModule builds them in configure_model, which planning never calls.
        try:
            self.config_init = self.parser.instantiate(self.config)  # jsonargparse >= 4.49; was instantiate_classes
        except (ValueError, FileNotFoundError) as err:  # the module's or the data's own message names the fix
            sys.exit(report_error(err.__cause__ if isinstance(err.__cause__, (ValueError, OSError)) else err,
                                  bool(self.config[PLAN].get("json"))))
        self.model = self._get(self.config_init, "model")
        self.datamodule = self._get(self.config_init, "data")

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        if subcommand == PLAN:
            self.plan()
        else:
            check_placement(self.trainer, self.model)  # before the Trainer launches any rank
            super()._run_subcommand(subcommand)

    def plan(self) -> None:
        """Run ``plan``: print the plans of the configured run (or of the named sizes); exit 2 on bad input."""
        config = self.config_init[PLAN]
        options = PlanOptions(**{name: config[name] for name in self._subcommand_method_arguments[PLAN]})
        configured = self.model is not None or self.datamodule is not None
        training_run = functools.partial(self._training_run, options, config.trainer) if configured else None
        status = run_plan_command(options, training_run)
        if status:
            sys.exit(status)

    def _training_run(self, options: PlanOptions, trainer: Namespace) -> TrainingRun:
        """What ``fit`` would run with this config: the workload (as ``PlacementTuner`` reads it), the cluster
        (``--cluster``, or the trainer's cpu devices) and the strategy's plan."""
        module, datamodule = self.model, self.datamodule
        if module is None or datamodule is None:
            missing = "model" if module is None else "data"
            raise ValueError(f"The training config has no {missing} section: plan reads the run from both, as fit "
                             f"does. Add {missing} (model.actor and model.tokenizer, or data.prompts), or give no "
                             "training config to plan named sizes (--actor ...).")
        datamodule.setup("fit")  # reads and tokenises the prompts (truncated at data.max_prompt_length); no model
        workload = workload_from_data(module, datamodule)
        critic = workload.critic.name if workload.critic is not None else None
        workload = replace(workload, name=workload_name(workload.actor.name, critic, workload.algorithm,
                                                        workload.num_samples, workload.lora_rank))
        cluster, processes, cluster_note = _cluster_of(options.cluster, trainer)
        prompt_note = (f"Prompt length {workload.prompt_length}: the mean longest tokenised prompt of a batch of "
                       f"data.batch_size {datamodule.batch_size} prompts, as PlacementTuner reads it.")
        strategy, strategy_plan = _strategy_plan(trainer.strategy)
        tuner = any(isinstance(callback, PlacementTuner) for callback in trainer.callbacks or [])
        dataset = datamodule.dataset
        profile_inputs = {"reward_fn": module.reward_fn, "tokenizer": module.tokenizer,
                          "prompts": dataset.prompts[:64], "fields": dataset.fields[:64],
                          "vllm_engine_args": module.generation.vllm_engine_args}
        return TrainingRun(workload, cluster, processes, strategy, strategy_plan, module.generation.batch_size,
                           module.ppo.micro_batch_size, tuner, notes=(cluster_note, prompt_note),
                           profile_inputs=profile_inputs,
                           measure_phases=functools.partial(measure_phases, module, datamodule,
                                                            iterations=CALIBRATION_ITERATIONS, skip=6))

    @override
    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` before anything else runs (weights-only, so an empty, truncated or crafted file
        fails here with its name). Unlike LightningCLI, the checkpoint's saved hyperparameters do not override the
        config: the config is the run's source of truth, and it holds what they cannot (optimizer builders)."""
        subcommand = self.config.get("subcommand") or ""
        ckpt_path = self.config.get(subcommand, {}).get("ckpt_path")
        if ckpt_path == AUTO:
            if subcommand != "fit":
                raise ValueError(f"--ckpt_path auto resumes training (fit), not {subcommand}: pass the path of the "
                                 "checkpoint to evaluate, or 'last' / 'best'.")
            return  # resolved in before_fit, once the trainer knows its directories
        if ckpt_path in LIGHTNING_CHECKPOINT_NAMES:
            return  # Lightning resolves it (and the strategy reads the file it finds, weights-only)
        if ckpt_path and "://" not in str(ckpt_path):
            load_checkpoint_file(ckpt_path)

    @override
    def before_instantiate_classes(self) -> None:
        """Name a mistyped strategy before Lightning does (its error lists none of the registered names), and a key
        that no model spec has (``--model.actor.model_name_or_path``, TRL's name for ``path``)."""
        config = self.config.get(self.config.get("subcommand") or "", {})
        check_model_spec_keys(config.get("model") or {})
        strategy = config.get("trainer", {}).get("strategy")
        if not isinstance(strategy, str) or strategy == "auto" or strategy in StrategyRegistry or "." in strategy:
            return  # a strategy object or class path, or a name Lightning knows
        ours = sorted(name for name in StrategyRegistry if name.startswith("rlhf_"))
        close = difflib.get_close_matches(strategy, list(StrategyRegistry), n=1)
        hint = f"Did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"Unknown --trainer.strategy {strategy!r}. {hint}The placement strategies are "
                         f"{', '.join(ours)}; Lightning's own include 'auto', 'ddp' and 'fsdp'. A custom plan: "
                         "class_path lightning_app_rlhf.PlacementStrategy with init_args.plan.")

    def before_predict(self) -> None:
        """Add the default :class:`PredictionWriter` (``--predictions``) unless the trainer has a prediction writer
        of its own (``--trainer.callbacks``). Drop the checkpoint callbacks a config lists for ``fit``: ``predict``
        saves no checkpoint, and Lightning would restore theirs from ``--ckpt_path`` only to warn that the run's
        directory changed."""
        setting = self.config_init[self.subcommand].get("predictions", True)
        callbacks = [c for c in self.trainer.callbacks if not isinstance(c, ModelCheckpoint)]
        self.trainer.callbacks = callbacks + missing_default_callbacks(callbacks, "predict", setting)

    def before_fit(self) -> None:
        """Resolve ``--ckpt_path auto``; a PlacementTuner must see ``--ckpt_path`` before the models are built, to
        reuse the saved plan."""
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt_path == AUTO:
            ckpt_path = self.config_init[self.subcommand]["ckpt_path"] = _newest_checkpoint_of(self.trainer)
        if ckpt_path and is_sharded_checkpoint(ckpt_path) and not isinstance(self.trainer.strategy, PlacementStrategy):
            raise CheckpointError(f"Checkpoint {ckpt_path} is a directory with sharded roles, which only a placement "
                                  f"strategy reads; this run uses {type(self.trainer.strategy).__name__}. Resume with "
                                  "--trainer.strategy rlhf_flattening (or the strategy it was saved with).")
        for callback in self.trainer.callbacks:
            if isinstance(callback, PlacementTuner) and callback.ckpt_path is None:
                callback.ckpt_path = ckpt_path


MODEL_ROLES = ("actor", "critic", "reference", "reward_model")
"""The model arguments of :class:`RLHFModule` that take a :class:`~lightning_app_rlhf.models.roles.ModelSpec`."""
MODEL_SPEC_ALIASES = {"model_name_or_path": "path", "pretrained_model_name_or_path": "path",
                      "torch_dtype": "dtype", "lora_config": "lora", "peft_config": "lora"}
"""Other libraries' names (TRL's ``ModelConfig``, transformers' ``from_pretrained``) for a model spec's fields."""


def check_model_spec_keys(model: Namespace | dict[str, Any]) -> None:
    """Refuse a key that no :class:`~lightning_app_rlhf.models.roles.ModelSpec` has in a model argument given as a
    mapping (the type also takes any dict, so jsonargparse lets it through to a ``TypeError`` deep in the module),
    naming the flag and the field meant."""
    model = model.get("init_args", model) if "class_path" in model else model
    known = [f.name for f in fields(ModelSpec)]
    for role in MODEL_ROLES:
        spec = model.get(role)
        spec = dict(vars(spec)) if isinstance(spec, Namespace) else spec
        for key in spec if isinstance(spec, dict) else ():
            if key in known:
                continue
            close = MODEL_SPEC_ALIASES.get(key) or next(iter(difflib.get_close_matches(key, known, n=1)), None)
            hint = f" Did you mean --model.{role}.{close}?" if close else ""
            raise ValueError(f"--model.{role}.{key}: a model spec has no field {key!r}.{hint} Its fields: "
                             f"{', '.join(known)} (docs/models.md).")


def check_placement(trainer: Trainer, module: Any) -> None:
    """Build a placement strategy's plan for this run in this process, before the Trainer launches the ranks, which
    would each refuse it (an impossible split, say Separation's default ratio on 3 devices): one message, printed
    once, naming the flags that fix it. Nothing for another strategy."""
    strategy = trainer.strategy
    algorithm = getattr(module, "algorithm", None)
    if isinstance(strategy, PlacementStrategy) and algorithm is not None:
        checked_plan(strategy.build_plan, algorithm.roles, algorithm.name, trainer.world_size, trainer.num_devices)


def run_directories(trainer: Trainer) -> list[Path]:
    """Where ``trainer`` writes checkpoints: each ModelCheckpoint's ``dirpath``, each logger's root directory (all its
    versions: a restarted job logs to a new one), and ``trainer.default_root_dir`` (SLURM's requeue checkpoints)."""
    directories = [Path(c.dirpath) for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]
    for logger in trainer.loggers:
        root = getattr(logger, "root_dir", None) or logger.save_dir
        if root:
            directories.append(Path(root))
    directories.append(Path(trainer.default_root_dir))
    return list(dict.fromkeys(d.resolve() for d in directories))


def _newest_checkpoint_of(trainer: Trainer) -> str | None:
    """``--ckpt_path auto``: the newest complete checkpoint in the run's directories (:func:`run_directories`), or
    None to start from scratch; says which on rank 0, and warns of newer checkpoints it passed over."""
    directories = run_directories(trainer)
    path, passed_over = newest_complete_checkpoint(directories)
    for reason in passed_over:
        rank_zero_warn(f"--ckpt_path auto passes over a checkpoint: {reason}")
    where = ", ".join(map(str, directories))
    if path is None:
        rank_zero_info(f"--ckpt_path auto: no complete checkpoint under {where}: training starts from scratch.")
        return None
    rank_zero_info(f"--ckpt_path auto: resuming from {path}, the newest complete checkpoint under {where}.")
    return str(path)


def _list_registered_backends(parser: LightningArgumentParser) -> None:
    """Show the backends registered now in every ``--*.generation.backend`` option's usage (``{eager,static}``, as
    for a ``Literal``) and at the end of its help: the field is a plain ``str`` checked against the registry (a
    backend registers itself), so neither its type nor its docstring can list a backend added by the user's own
    code. An unknown name fails when the config is built, with the same list."""
    names = registered_backends()
    for action in parser._actions:
        if action.dest.endswith("generation.backend"):
            action.metavar = "{" + ",".join(names) + "}"
            action.help = f"{action.help or ''} Registered: {', '.join(names)}.".lstrip()


class StrategyOptionsAction(ActionTypeHint):
    """``--trainer.strategy``, whose options (``--trainer.strategy.max_staleness 1``) also follow a registered name
    (``rlhf_separation``, ``ddp``), given on the command line or in a config file: before the first option the name
    becomes its class path and the registry's arguments (:func:`registered_strategy_spec`), as if the user had given
    ``--trainer.strategy lightning_app_rlhf.strategies.SeparationStrategy``. A name alone stays a name; a class path
    is jsonargparse's as before."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 4:  # parser, cfg, value, option string: an option given on the command line
            _, cfg, _, option = args
            previous = cfg.get(self.dest) if cfg is not None else None
            if self.get_option_string_base(option) and isinstance(previous, str) and "." not in previous:
                cfg.update(registered_strategy_spec(previous, option), self.dest)
        return super().__call__(*args, **kwargs)


def registered_strategy_spec(name: str, option: str = "--trainer.strategy.OPTION") -> Namespace:
    """The class path and init args that the strategy registry's ``name`` stands for (what Lightning builds for it).

    Raises:
        ValueError: ``name`` is no registered strategy, or one whose registered arguments no config can hold (a
            custom preset's plan function defined in ``__main__``): the message names the class path to use.
    """
    if name not in StrategyRegistry:
        close = difflib.get_close_matches(name, list(StrategyRegistry), n=1)
        hint = f"Did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"{option} sets an option of --trainer.strategy, but {name!r} is no registered strategy. "
                         f"{hint}Give a registered name (rlhf_flattening, rlhf_interleaving, rlhf_separation, ddp, ...) "
                         "or a class path.")
    entry = StrategyRegistry[name]
    class_path = f"{entry['strategy'].__module__}.{entry['strategy'].__qualname__}"
    init_args = {}
    for key, value in entry["init_params"].items():
        if callable(value):
            value = f"{getattr(value, '__module__', '__main__')}.{getattr(value, '__qualname__', '<?>')}"
            if value.startswith("__main__.") or "<" in value:  # a lambda, a local function, or one of the script
                raise ValueError(f"{option}: strategy {name!r} is registered with {key}={entry['init_params'][key]!r}, "
                                 f"which no config can name, so it takes no options on the command line. Give "
                                 f"--trainer.strategy {class_path} and its {key} as an importable path instead.")
        init_args[key] = value
    return Namespace(class_path=class_path, init_args=Namespace(**init_args))


def _accept_strategy_options(parser: LightningArgumentParser) -> None:
    """Let ``--trainer.strategy``'s options follow a registered name (:class:`StrategyOptionsAction`)."""
    for action in parser._actions:
        if action.dest == "trainer.strategy" and type(action) is ActionTypeHint:
            action.__class__ = StrategyOptionsAction


def _add_predictions_option(parser: LightningArgumentParser) -> None:
    """``predict --predictions``: where the default :class:`PredictionWriter` writes the completions as JSONL."""
    parser.add_argument(
        "--predictions", type=bool | str, default=True,
        help="Write the completions, one JSON line per prompt (index, prompt, completion, reward): true (default) to "
             "predictions.jsonl in the run's log directory, a file path, or false to write none. A prediction "
             "writer in --trainer.callbacks replaces it.")


def _raised_here(error: BaseException) -> bool:
    """Whether ``error`` was raised by this package's own code (its innermost frame is in it): a check of the
    config's values, whose message says what to change."""
    traceback, package = error.__traceback__, Path(__file__).resolve().parent
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback is not None and Path(traceback.tb_frame.f_code.co_filename).resolve().is_relative_to(package)


def _first_sentence(method: Any) -> str:
    """The first sentence of a method's docstring: its line in the top-level ``--help``."""
    paragraph = (inspect.getdoc(method) or "").split("\n\n", 1)[0].replace("\n", " ")
    return paragraph.split(". ", 1)[0].rstrip(".") + "."


def _cluster_of(cluster: str | None, trainer: Namespace) -> tuple[str, int | None, str]:
    """The cluster to plan for, the processes the trainer config launches (None: the machine decides), and a note
    saying where the cluster came from.

    Args:
        cluster: ``--cluster``; None derives it from the trainer's cpu devices.
        trainer: The parsed ``trainer`` section.

    Raises:
        ValueError: Without ``--cluster`` the trainer's devices are GPUs (or other accelerators), whose type the
            config does not say.
    """
    accelerator, devices, nodes = trainer.accelerator, trainer.devices, trainer.num_nodes
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    processes = None
    if on_cpu:
        try:
            processes = nodes * (CPUAccelerator.auto_device_count() if devices == "auto" else
                                 CPUAccelerator.parse_devices(devices))
        except TypeError as err:
            raise ValueError(f"trainer.devices={devices!r} on the cpu: {err} Set --trainer.devices to a number of "
                             "processes, or pass --cluster NODESxDEVICESxcpu.") from err
    elif isinstance(devices, int) or (isinstance(devices, str) and devices.isdigit()):
        processes = nodes * int(devices)
    if cluster is not None:
        return cluster, processes, f"Cluster {cluster} from --cluster."
    if not on_cpu:
        count = devices if processes is not None else "DEVICES"
        raise ValueError(f"The config trains on trainer.accelerator={accelerator!r}, whose device type the planner "
                         f"needs: pass --cluster {nodes}x{count}xTYPE with TYPE one of {known_devices()}, e.g. "
                         f"--cluster {nodes}x8xA100-80GB.")
    derived = f"{nodes}x{processes // nodes}xcpu"
    note = (f"Cluster {derived} from trainer.num_nodes {nodes} x trainer.devices {devices} on the cpu (pass --cluster "
            "to plan for other devices).")
    return derived, processes, note


def _strategy_plan(strategy: Any) -> tuple[str, Callable[[int, tuple[str, ...]], PlacementPlan] | None]:
    """``trainer.strategy`` by name, and its plan builder ``(world_size, roles) -> PlacementPlan`` when it is a
    placement strategy (a registered name such as ``rlhf_separation``, or an instance); None otherwise."""
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        entry = StrategyRegistry[strategy]
        if issubclass(entry["strategy"], PlacementStrategy):
            strategy = entry["strategy"](**entry["init_params"])  # stores its arguments; sets nothing up
    return name, strategy.build_plan if isinstance(strategy, PlacementStrategy) else None


def _shows_option_help(args: Sequence[str]) -> bool:
    """Whether the command line asks for text that carries the options' descriptions: ``--help`` or ``-h`` (also a
    class's, ``--model.help CLASS``), or ``--print_config=comments``."""
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag in ("-h", "--help") or flag.endswith(".help"):
            return True
        following = args[i + 1] if i + 1 < len(args) else ""
        if flag == "--print_config" and "comments" in (value or following):
            return True
    return False


def main(args: list[str] | None = None, prog: str | None = None) -> RLHFCLI:
    """Entry point of ``python -m lightning_app_rlhf`` and the ``lightning-app-rlhf`` console script.

    Args:
        args: The command line (default: ``sys.argv[1:]``).
        prog: The program name in usage lines (default: the script's name).
    """
    # Dataclass field docstrings, for --help and commented configs only: reading them parses each class's source,
    # about 60% of building the parser (4.4 -> 1.7 s of CPU per command, on every rank of a fit).
    arguments = list(sys.argv[1:] if args is None else args)
    if DEBUG_FLAG in arguments:  # ours, not the config's: off the command line, into the variable ranks inherit
        arguments = [argument for argument in arguments if argument != DEBUG_FLAG]
        os.environ[DEBUG_ENV] = "1"
        if args is None:
            sys.argv[1:] = arguments  # what jsonargparse reads, and a launcher re-runs per rank
    set_parsing_settings(docstring_parse_attribute_docstrings=_shows_option_help(arguments))
    ignore_upstream_warnings()  # raised by dependencies' own calls, or advice that does not apply: nothing to change
    try:
        return RLHFCLI(
            RLHFModule,
            PromptDataModule,
            args=None if args is None else arguments,  # LightningCLI warns when given both
            only_subcommand=arguments[0] if arguments else None,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,  # the module builds its own two optimizers
            parser_class=RLHFArgumentParser,
            parser_kwargs={"description": DESCRIPTION, **({"prog": prog} if prog else {})},
        )
    except Exception as err:  # at parsing, instantiation, the Trainer's setup (batch split, prompt lengths) or a run
        if debug_requested():
            raise
        consequence = any(isinstance(e, PlacementError) for e in causes(err))  # of another rank's failure
        if not first_report(wait_s=10.0 if consequence else 0.0, claim=not consequence):
            sys.exit(1)  # another rank of this job reported it (the same error, or the one this rank stopped for)
        status = report_user_error(err)
        if status is None:
            raise
        sys.exit(status)


def report_user_error(error: BaseException) -> int | None:
    """Print an error the user caused as one ``error:`` line naming the fix, and return the exit status; None for an
    error whose whole traceback should show (a fault of this package or of a library). 30 to 120 lines of
    jsonargparse and Lightning frames would bury the one line that matters. In order:

    - a setting this package refused (:func:`config_error`): its message names the fix (status 2);
    - a package that is not installed (a logger's optional dependency): the ``pip install`` (status 2);
    - an error raised in the user's own code (a reward function, a prompts function, a callback): that code's frames
      and exception as Python prints them, then one line (status 1);
    - a value jsonargparse or Lightning refused while building the classes (a ``MisconfigurationException``, a
      class's refusal of its arguments): its message in one line (status 2).
    """
    refused = config_error(error)
    if refused is not None:
        return report_error(refused)
    missing = missing_package(error)
    if missing is not None:
        built = next(iter(re.findall(r"Problem with given class_path '([\w.]+)'", str(error))), None)
        what = f"{built} cannot be built: " if built else ""
        sys.stderr.write(f"error: {what}{missing[0].rstrip('.')}. Install it (`{missing[1]}`), or leave out the "
                         f"option that needs it. ({DEBUG_FLAG} shows the traceback.)\n")
        return 2
    user = user_frames(error)
    if user is not None:
        raised, frames = user
        ours = next((e for e in causes(error) if e is not raised and _raised_here(e)), None)
        message = str(ours) if ours is not None else (f"{type(raised).__name__}: {raised} was raised by your code, "
                                                      "in the frames above. Fix it there.")
        sys.stderr.write("".join(frames))
        sys.stderr.write(f"error: {message} ({DEBUG_FLAG} shows the whole traceback.)\n")
        return 1
    failed = next((e for e in causes(error) if isinstance(e, PlacementError)), None)
    if failed is not None:  # another rank died or stopped answering, and reported nothing (killed, out of memory)
        sys.stderr.write(f"error: {type(failed).__name__}: {failed}\n")  # its class: what failed, not a setting
        return 1
    refusal = next((e for e in causes(error) if isinstance(e, MisconfigurationException) or (
        isinstance(e, ValueError) and "Does not validate against any of the Union subtypes" in str(e))), None)
    if refusal is not None:
        sys.stderr.write(f"error: {one_line(str(refusal))} ({DEBUG_FLAG} shows the traceback.)\n")
        return 2
    return None


def console_main() -> None:
    """The ``lightning-app-rlhf`` console script: :func:`main`, then exit status 0. (The script runs
    ``sys.exit(console_main())``: with :func:`main`, which returns the CLI object, ``sys.exit`` would print that object
    and exit with status 1 after a successful run.)"""
    main()
