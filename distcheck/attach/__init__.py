"""``distcheck attach``: diagnose a job that is hung right now, which distcheck did not launch, from
outside and read-only (``discover`` its ranks in /proc, ``read`` their stacks and counters, ``position``
says where each stands, ``flight`` reads the Flight Recorder dumps the job left, ``judge`` turns that into
the run path's own verdict, ``nodes`` brings every node's reads to node 0, ``session`` ties them)."""
