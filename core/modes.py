"""The decoding modes, in one list: the engine's, the plan's and the CLI's."""

MODES = ("plain", "chain", "tree", "triforce")
REQUEST_MODES = ("auto",) + MODES  # auto: the plan's mode for this machine
