"""The loop on a Ray cluster: node actors, vLLM replicas, and shipping recorded calls to the driver."""
