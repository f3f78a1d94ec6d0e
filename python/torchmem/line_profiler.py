"""placeholder"""


def profile(fn=None): return fn


def print_profile(): ...
