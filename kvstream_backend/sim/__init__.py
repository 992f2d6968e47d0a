"""kvsim: a trace-driven simulator of the KVStream performance model (``kvstream sim``)."""
