"""Run keeping, shared by both loops: the run folder and where a run starts (``run_dir``), its
checkpoints (``checkpoint``, ``plain_state``), SIGTERM and out-of-memory (``stopping``,
``out_of_memory``), what rank 0 writes (``run_outputs``), the header a run prints
(``run_header``) and the options every command shares (``run_options``). A floor below the
sources: nothing here knows a loop, a stage or an algorithm."""
