"""The memory plan: a run's peak from its resolved config and the shapes, before any weights load
(``plan``, formulas in ``memory_model``), and the micro-batch budget derived from it
(``micro_batch_budget``). A room above the loops: it reads the config (``RLRun``'s derived
properties among it) and never a stage of the loop."""
