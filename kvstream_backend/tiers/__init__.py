"""One tier at run time: its index and files (:mod:`.tier`), the on-disk steps of its I/O
(:mod:`.copies`), the thread that runs them (:mod:`.worker`) on the jobs the engine gives it
(:mod:`.jobs`), its health and meters (:mod:`.runtime`, :mod:`.accounting`), and the emulated
bandwidth of a test tier (:mod:`.emulate`)."""
