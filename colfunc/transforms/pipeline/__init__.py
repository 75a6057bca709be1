"""Pipeline parallelism: the ``pipeline`` transform, its schedules as data, and their simulator."""

from colfunc.transforms.pipeline.runtime import Trace
from colfunc.transforms.pipeline.schedules import SCHEDULES, Action, Schedule, build
from colfunc.transforms.pipeline.simulate import Costs, ScheduleError, Simulation, simulate
from colfunc.transforms.pipeline.transform import (
    PipelineConfig,
    PipelineLayout,
    pipeline,
    pipeline_from_config,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Costs",
    "PipelineConfig",
    "PipelineLayout",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "Trace",
    "build",
    "pipeline",
    "pipeline_from_config",
    "simulate",
]
