"""vd's replayer: drive any forward through a golden's stored steps and judge it (`replayer.replay`)."""

from replayer.replay import replay

__all__ = ["replay"]
