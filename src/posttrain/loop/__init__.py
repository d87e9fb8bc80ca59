"""The online loop shared by GRPO (and later OPD): collect, score, train, sync, log."""
