"""What a run prints beyond its own results: nothing a user cannot act on (issue "The first hour, second pass").
The progress bar's speed and version, Lightning's product tips, a resumable prompt loader (no warning on a resume
that is exact), and the first error of a user's tool."""

from __future__ import annotations

import logging
import warnings

import pytest
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from rich.progress import Task

from lightning_app_rlhf.agents import tools
from lightning_app_rlhf.agents.tools import ToolCall, call_tool
from lightning_app_rlhf.callbacks import RLHFProgressBar
from lightning_app_rlhf.callbacks.progress_bar import IterationSpeedColumn
from lightning_app_rlhf.core.upstream_warnings import RANK_ZERO_LOGGERS, ignore_upstream_warnings
from lightning_app_rlhf.data import PromptLoader


@pytest.mark.parametrize(("speed", "text"), [(0.004, "250.0s/it"), (0.5, "2.0s/it"), (3.0, "3.00it/s"), (None, "")])
def test_the_speed_reads_seconds_per_iteration_below_one_iteration_per_second(speed, text, monkeypatch):
    task = Task(0, "train", None, 0, _get_time=lambda: 0.0)
    monkeypatch.setattr(Task, "speed", property(lambda self: speed))
    assert IterationSpeedColumn(style="").render(task).plain == text


def test_the_bar_shows_the_version_as_an_integer(monkeypatch):
    monkeypatch.setattr("lightning.pytorch.callbacks.RichProgressBar.get_metrics",
                        lambda self, trainer, module: {"v_num": 7, "reward/mean": 0.25})
    assert RLHFProgressBar().get_metrics(None, None) == {"v_num": "7", "reward/mean": 0.25}


def test_lightning_tips_are_dropped_and_its_other_messages_kept():
    ignore_upstream_warnings()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    loggers = [logging.getLogger(name) for name in RANK_ZERO_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        rank_zero_info("💡 Tip: For seamless cloud logging, try installing litlogger")
        rank_zero_info("GPU available: False, used: False")
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert seen == ["GPU available: False, used: False"]


def test_the_prompt_loader_is_resumable_in_lightnings_sense():
    """Lightning warns on a mid-epoch resume unless the loader has a state; ours starts at the checkpoint's
    iteration (PromptSampler), so its state is empty and the resume is exact (tests/test_placements.py)."""
    loader = PromptLoader(list(range(4)), batch_size=2)
    assert isinstance(loader, _Stateful) and loader.state_dict() == {}
    loader.load_state_dict({})


def test_the_first_error_of_a_tool_is_printed_once_with_its_name(monkeypatch):
    monkeypatch.setattr(tools, "_tool_error_reported", False)

    def divide(a: int, b: int) -> float:
        """Divide.

        Args:
            a: Numerator.
            b: Denominator.
        """
        return a / b

    call = ToolCall("divide", {"a": 1, "b": 0})
    with pytest.warns(UserWarning, match=r"The tool 'divide' raised ZeroDivisionError: division by zero\. The model "
                                         r"gets this error as the tool's answer"):
        assert call_tool(call, {"divide": divide}) == ("Error: ZeroDivisionError: division by zero", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert call_tool(call, {"divide": divide})[1]  # the second is counted, not printed


def test_the_bar_counts_all_of_the_epochs_batches_when_max_steps_ends_it_early():
    """A 2-batch epoch that ``max_steps`` stops after its first batch reads ``1/2``, not Lightning's ``1/1``."""
    from types import SimpleNamespace

    bar = RLHFProgressBar()
    bar._trainer = SimpleNamespace(num_training_batches=2, max_epochs=-1, max_steps=3, global_step=2)
    assert bar.total_train_batches == 2
