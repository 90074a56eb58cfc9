"""The performance model of this runtime: platforms (prices, speeds), per-stage time and cost, sync."""
