"""placeholder"""


class Monitor: ...
