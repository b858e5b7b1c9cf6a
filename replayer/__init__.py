"""vd's replayer: drive any forward through a golden's stored steps and judge it (`replay`), compare two
goldens without a model (`replayer.diff`), and render what a replay concludes (`replayer.render`)."""

from replayer.replay import ReplaySettings, replay
from replayer.report import Report

__all__ = ["Report", "ReplaySettings", "replay"]
