"""Warnings that upstream code raises and a user of this package cannot act on, ignored by the command line and by
:class:`~lightning_app_rlhf.RLHFModule` under a Trainer (:func:`ignore_upstream_warnings`), each with its reason:

- :data:`UPSTREAM_WARNINGS`: deprecations that dependencies raise about their own calls, not ours; the test suite
  ignores them too (where every other deprecation is an error);
- :data:`INAPPLICABLE_WARNINGS`: advice of Lightning's that does not apply to an RLHF run and that no setting turns
  off;
- :data:`LIGHTNING_TIPS`: the product tips Lightning logs on every run (litlogger, litmodels), which no setting
  turns off either.

Plain data and the standard library only. ``tests/conftest.py`` turns :data:`UPSTREAM_WARNINGS` into pytest
``filterwarnings`` entries. Add a deprecation only for a warning raised inside a dependency's own code path (its stack
shows no call of ours deprecated), and remove it when the fixed release is in ``constraints.txt``. A warning that this
package causes is fixed where it is caused, not added here.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class UpstreamWarning:
    """One upstream deprecation warning, matched as Python's warning filters match.

    Args:
        message: A regular expression the start of the warning's message must match (no ``:``).
        category: The warning class.
        module: A regular expression the module the warning is attributed to must match ("" for any).
        upstream: Where it is tracked (an issue or pull request), or what raises it where none is filed, and why a
            user cannot act on it.
    """

    message: str
    category: type[Warning]
    module: str
    upstream: str

    def ignore(self) -> None:
        """Ignore this warning in this process (``warnings.filterwarnings``)."""
        warnings.filterwarnings("ignore", message=self.message, category=self.category, module=self.module)

    def pytest_filter(self) -> str:
        """This warning as a pytest ``filterwarnings`` entry that ignores it."""
        return f"ignore:{self.message}:{self.category.__name__}:{self.module}"


UPSTREAM_WARNINGS: tuple[UpstreamWarning, ...] = (
    UpstreamWarning(
        r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, "",
        "Lightning 2.6's CombinedLoader under torch 2.13, on every Trainer.fit: Lightning-AI/pytorch-lightning#21326",
    ),
    UpstreamWarning(
        "", DeprecationWarning, r"lightning\.pytorch\.cli",
        "LightningCLI's own jsonargparse calls (add_instantiator, instantiate_classes, skip_none) under jsonargparse "
        ">= 4.49: Lightning-AI/pytorch-lightning#21900, fixed by #21906 after Lightning 2.6.6",
    ),
    UpstreamWarning(
        "`is_gradient_checkpointing` is deprecated", FutureWarning, "",
        "peft 0.21.2's get_peft_model reads transformers 5.24's deprecated model.is_gradient_checkpointing "
        "(no upstream issue found)",
    ),
    UpstreamWarning(
        r"`torch\.jit\.script_method` is deprecated", DeprecationWarning, "",
        "torch 2.13's own torch.utils.mkldnn, imported by torch._inductor when DeepSpeed 0.19.8 compiles its Muon "
        "optimizer at import (in every ZeRO engine's optimizer check)",
    ),
    UpstreamWarning(
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning, "",
        "DeepSpeed 0.19.8's ZeRO collectives (deepspeed.comm, partition_parameters) under torch 2.13's renamed all_gather_single and "
        "reduce_scatter_single; the same rename is huggingface/accelerate#4269",
    ),
)
"""Every upstream deprecation the command line and the tests ignore."""


INAPPLICABLE_WARNINGS: tuple[UpstreamWarning, ...] = (
    UpstreamWarning(
        "Using ModelCheckpoint with manual optimization and every_n_train_steps", UserWarning, "",
        "Lightning 2.6's ModelCheckpoint warns, with a 12-line code sample, on every every_n_train_steps save under "
        "manual optimization unless the module keeps `saved_models` and a `layer` (a pattern of Lightning's own "
        "test). An RLHF iteration's checkpoint is meant to hold the weights after its optimizer steps, which is what "
        "it saves; only removing every_n_train_steps would silence it",
    ),
    UpstreamWarning(
        r"The '\w+' does not have many workers which may be a bottleneck", Warning, "",
        "Lightning advises DataLoader workers on any machine with more than 2 cores per device. A batch of prompts is "
        "a few lists of token ids, collated in microseconds while generation takes seconds: workers would only add a "
        "process (and its memory) per rank. data.num_workers stays available",
    ),
)
"""Lightning's advice that does not apply to an RLHF run; the command line and the module ignore it."""


LIGHTNING_TIPS = "💡 Tip:"
"""How Lightning 2.6 starts the tips it logs (``rank_zero_info``) on every run without LitLogger, and on every run
that checkpoints without litmodels: advertisements for its cloud services, not advice about the run."""

RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
"""The loggers Lightning's ``rank_zero_info`` writes to."""


class _DropLightningTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_TIPS)


def ignore_upstream_warnings() -> None:
    """Ignore every warning of :data:`UPSTREAM_WARNINGS` and :data:`INAPPLICABLE_WARNINGS` in this process, and drop
    :data:`LIGHTNING_TIPS` from Lightning's logs."""
    for upstream in (*UPSTREAM_WARNINGS, *INAPPLICABLE_WARNINGS):
        upstream.ignore()
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLightningTips) for f in logger.filters):
            logger.addFilter(_DropLightningTips())
