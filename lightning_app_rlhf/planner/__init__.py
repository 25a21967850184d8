"""The adaptive placement planner: cluster and workload descriptions, a cost model, APP and ReaLHF searches.

Plain Python and PyTorch, no Lightning::

    from lightning_app_rlhf.planner import llama_workload, parse_cluster, plan_placement

    result = plan_placement(parse_cluster("1x8xA100-80GB"), llama_workload("llama-7b"), seed=0)
    result.best.plan             # a PlacementPlan
    result.best.choice           # ... with its generation batch and micro-batch
    result.candidates            # presets and searched plans: time, samples/s, memory per rank, rejection
"""

from lightning_app_rlhf.planner.cluster import (
    DEVICE_TYPES,
    Cluster,
    DeviceType,
    cluster_from_environment,
    measure_background_cores,
    measure_compute_shares,
    parse_cluster,
)
from lightning_app_rlhf.planner.cost_model import CostModel, Estimate, PlanChoice, RankMemory, Task, simulate
from lightning_app_rlhf.planner.profiler import Profile, profile_workload
from lightning_app_rlhf.planner.search import (
    Candidate,
    PlannerError,
    PlannerResult,
    app_search,
    mcmc_search,
    plan_placement,
)
from lightning_app_rlhf.planner.workload import (
    NAMED_SIZES,
    RoleShape,
    Workload,
    installed_wrappers,
    llama_workload,
    padded_prompt_length,
    role_shape,
    workload_from_data,
    workload_from_module,
)

__all__ = [
    "DEVICE_TYPES",
    "NAMED_SIZES",
    "Candidate",
    "Cluster",
    "CostModel",
    "DeviceType",
    "Estimate",
    "PlanChoice",
    "PlannerError",
    "PlannerResult",
    "Profile",
    "RankMemory",
    "RoleShape",
    "Task",
    "Workload",
    "app_search",
    "cluster_from_environment",
    "installed_wrappers",
    "llama_workload",
    "mcmc_search",
    "measure_background_cores",
    "measure_compute_shares",
    "padded_prompt_length",
    "parse_cluster",
    "plan_placement",
    "profile_workload",
    "role_shape",
    "simulate",
    "workload_from_data",
    "workload_from_module",
]
