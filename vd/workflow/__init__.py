"""vd in a team's workflow, above the recorder and the replayer: a suite of goldens declared once
(`vd.workflow.declare`), recorded and replayed together with each model loaded once (`vd.workflow.suite`),
refreshed with a reason, a change summary and a history (`vd.workflow.refresh`), listed with what is
stale or orphaned (`vd.workflow.status`), and run from pytest (`vd.workflow.plugin`)."""
