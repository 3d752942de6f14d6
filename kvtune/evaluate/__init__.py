"""KV capture, workloads, metrics and throughput measurement on real models."""
