"""Lightning callbacks for RLHF runs."""

from lightning_app_rlhf.callbacks.export_actor import ExportActor
from lightning_app_rlhf.callbacks.run_summary import RLHFRunSummary

__all__ = ["ExportActor", "RLHFRunSummary"]
