"""vd's recorder: run the reference (or drafter) feed on a trusted build and store a golden (`record`)."""

from vd.recorder.record import DEFAULT_PROMPT, RecordResult, RecordSettings, record

__all__ = ["DEFAULT_PROMPT", "RecordResult", "RecordSettings", "record"]
