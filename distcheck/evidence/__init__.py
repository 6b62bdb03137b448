"""Reading what a job left behind into the values ``diagnose/`` judges: a finished launch's files
(``collect``), a saved launch directory (``from_traces``), PyTorch Flight Recorder dumps
(``from_dumps``), and ``distcheck analyze``'s entry over any of them (``postmortem``). All the
I/O of judging is here, so the rules stay pure."""
