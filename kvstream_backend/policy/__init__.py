"""Pure policy: how tiers claim a step's chunks (:mod:`.routing`) and the model that replays it
(:mod:`.model`). No I/O, no threads, no clock but the one passed in."""
