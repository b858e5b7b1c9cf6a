"""The engine's verify path against the tiny golden: the vd_golden fixture comes with vd's pytest plugin."""

import engine


def test_engine_verify_path_matches_the_golden(vd_golden):
    report = vd_golden("tiny").replay(model=engine.factory())
    assert report is None or report.verdict == "PASS"  # None: the golden was just refreshed (--vd-update)
