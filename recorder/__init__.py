"""vd's recorder: run the reference feed on a trusted build and store a golden (`recorder.record`)."""

from recorder.record import DEFAULT_PROMPT, RecordResult, record

__all__ = ["DEFAULT_PROMPT", "RecordResult", "record"]
