"""The decoding modes, in one list: the engine's, the plan's and the CLI's."""

MODES = ("plain", "chain", "tree", "triforce", "dsi")  # dsi: speculation parallelism over target instances
REQUEST_MODES = ("auto",) + MODES  # auto: the plan's mode for this machine
MAX_DSI_WORKERS = 8  # CPU worker processes a dsi request may ask for
