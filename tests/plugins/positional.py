"""A plug-in whose factory takes no ``device=`` / ``dtype=`` keywords (the protocol's call), and ones that
return an int or None."""


def factory():
    return object()


def number(device, dtype):
    return 42


def nothing(device, dtype):
    return None
