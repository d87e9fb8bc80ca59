"""Launching a run on several processes: the SPMD policy world (torchrun) and its helpers."""
