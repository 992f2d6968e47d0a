"""``kvstream bench``: kvstream, static splits, LMCache disk and fio on the same chunks."""
