"""``distcheck attach``: diagnose a job that is hung right now, which distcheck did not launch, from
outside and read-only (``discover`` its ranks in /proc, ``read`` their stacks and counters, ``position``
says where each stands, ``judge`` turns that into the run path's own verdict, ``session`` ties them)."""
