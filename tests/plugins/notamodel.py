"""A plug-in whose factory returns something that is not a vd model."""


def factory(device, dtype):
    return object()
