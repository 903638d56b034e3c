"""Run telemetry: metrics sinks, progress display and the end-of-run report."""

from posttrain.telemetry.metrics import MetricsLogger
from posttrain.telemetry.progress import Progress
from posttrain.telemetry.report import write_failure_report, write_report

__all__ = ["MetricsLogger", "Progress", "write_failure_report", "write_report"]
