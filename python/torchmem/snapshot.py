"""placeholder"""


def capture(path, **kw): ...


def on_oom(directory): ...
