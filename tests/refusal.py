"""The check of a refusal as the command line words one (a `cli` fixture's result): exit 2, one line on stderr
starting ``vd: error: ``, no traceback, naming each of ``needles``."""


def refused(result, *needles: str) -> None:
    code, _, err = result
    assert code == 2, err
    assert err.startswith("vd: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
