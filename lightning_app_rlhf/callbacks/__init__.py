"""Lightning callbacks for RLHF runs."""

from lightning_app_rlhf.callbacks.defaults import default_callbacks, missing_default_callbacks
from lightning_app_rlhf.callbacks.export_actor import ExportActor
from lightning_app_rlhf.callbacks.log_completions import LogCompletions
from lightning_app_rlhf.callbacks.placement_summary import PlacementSummary
from lightning_app_rlhf.callbacks.placement_tuner import PlacementTuner
from lightning_app_rlhf.callbacks.prediction_writer import PredictionWriter
from lightning_app_rlhf.callbacks.preemption_checkpoint import PreemptionCheckpoint
from lightning_app_rlhf.callbacks.progress_bar import RLHFProgressBar
from lightning_app_rlhf.callbacks.role_lr_monitor import RoleLearningRateMonitor
from lightning_app_rlhf.callbacks.run_summary import RLHFRunSummary

__all__ = [
    "ExportActor",
    "LogCompletions",
    "PlacementSummary",
    "PlacementTuner",
    "PredictionWriter",
    "PreemptionCheckpoint",
    "RLHFProgressBar",
    "RLHFRunSummary",
    "RoleLearningRateMonitor",
    "default_callbacks",
    "missing_default_callbacks",
]
