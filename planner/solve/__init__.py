"""Plan: the exact search over partitions, memory tiers, data-parallel degree and sync algorithms."""
