"""The one place that knows how many processes a run has.

``process_group`` joins and leaves the policy ranks' group, ``world`` holds the run-level
collectives (trivial in one process), ``cells`` slices a collected batch into the ranks' data
cells, ``fsdp`` shards the policy and reduces over its mesh (``SingleProcess`` in one process), and
``weight_sync`` moves weights to a disaggregated rollout replica. Code outside this package calls
these without asking whether it runs in one process or several.
"""
