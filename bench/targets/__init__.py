"""inflight itself as a benchmark target: in-process engine or the running stack."""
