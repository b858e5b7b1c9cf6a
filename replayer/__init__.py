"""vd's replayer: drive any forward through a golden's stored steps and judge it (`replay`), compare two
goldens without a model (`vd.replayer.diff`), and render what a replay concludes (`vd.replayer.render`)."""

from vd.replayer.replay import ReplaySettings, open_for_replay, replay
from vd.replayer.report import Report

__all__ = ["Report", "ReplaySettings", "open_for_replay", "replay"]
